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

/// Whether [`children_follow_regions`] was called: then children can be held to a budget
/// (their agent starts in [`Region::follow_in_child`]; see [`RegionOptions::child_slots`]).
pub fn children_follow() -> bool {
    CHILDREN_FOLLOW.load(Ordering::Relaxed)
}

/// A descriptor for a forked child's copy of the region (see [`Forks::ByChild`]): as the
/// parent got one, without moves (write-protection tells the handler which of the child's
/// pages it wrote, see [`ForkChild`]).
pub(crate) fn open_for_child() -> Result<Uffd, Errno> {
    Uffd::open(TID | WP, false).or_else(|_| Uffd::open_device(TID | WP))
}

/// Closes the descriptor `fd` holds, if any, and leaves -1 there.
pub(crate) fn close_raw(fd: &std::sync::atomic::AtomicI32) {
    let raw = fd.swap(-1, Ordering::Relaxed);
    if raw >= 0 {
        // SAFETY: the descriptor was put there to be owned by whoever takes it out.
        drop(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) });
    }
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

/// Who forked (see [`Shared::fork_event`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Forker {
    /// This process, which announced the fork (`Region::prepare_fork`).
    Us,
    /// Forked child `i` (its index in `State::children`).
    Child(usize),
    /// A descendant the handler does not know (its child sent no agent's hello).
    Unknown,
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
/// side changes a page in the pager (a write-back, a delete), that contents is first kept for
/// every child that still reads it from there ([`Shared::settle`]): installed in the child,
/// or, for a child held to a budget, stored in the pager under the child's own page number.
/// When the child exits or execs, its descriptor reports that its memory is gone (ESRCH) and
/// it is forgotten, its own pages deleted.
///
/// A child gets a budget ([`Budget`]: as many resident pages as the parent's budget was at the
/// fork) when the region has a free child slot and the child's agent runs (`agent.rs`); other
/// children (a grandchild, one forked while every slot is taken, a fork made by system call
/// rather than the C library's `fork`) keep every page they touch, as before.
pub(crate) struct ForkChild {
    /// Its name for reads by ticket made for it (`ChildFetch`), which outlive its index.
    pub(crate) id: u64,
    pub(crate) uffd: Uffd,
    /// What each page is to the child: one of the `page::*` states.
    pub(crate) pages: Vec<u8>,
    /// Its memory is gone: forgotten at the handler's next turn.
    pub(crate) gone: bool,
    pub(crate) budget: Option<Budget>,
    /// Its faults' trend, as the region's own (`prefetch.rs`): the pages proposed are read
    /// with the faulting one and installed in it, one in `PREFETCH_CHECK` left as a guess
    /// (not installed) whose fault, or not, within the last `CHILD_GUESSES` says whether
    /// fetching ahead pays.
    prefetcher: Prefetcher,
    guesses: HashMap<usize, Mode>,
    guess_order: VecDeque<usize>,
    prefetch_seq: u64,
    /// Whether installing its pages write-protected pays (a child with a budget): a page
    /// never written is dropped without a copy, but each written one costs a fault more.
    /// Those installed writable are its own at once (`page::OWN`).
    protection: Protection,
}

/// Pages `settle_many` reads at once.
const SETTLE_BATCH: usize = 256;

/// Guesses a child's prefetcher keeps (see `ForkChild::prefetcher`).
const CHILD_GUESSES: usize = 64;

/// The tags of children's reads by ticket carry this bit (the region's own carry their page
/// number, far below it).
const CHILD_TAG: u64 = 1 << 61;

/// Whether a read by ticket was made for a forked child (`ChildFetch`).
pub(crate) fn is_child_tag(tag: u64) -> bool {
    tag & CHILD_TAG != 0
}

/// The tags of the reads of victims' pager copies kept for children (`settle_ahead`) carry
/// this bit and the page number.
const SETTLE_TAG: u64 = 1 << 60;

/// Whether a read by ticket was made by `settle_ahead`, and for which page.
pub(crate) fn settle_tag(tag: u64) -> Option<usize> {
    (tag & SETTLE_TAG != 0 && tag & CHILD_TAG == 0).then_some((tag & !SETTLE_TAG) as usize)
}

/// Victims' pager copies read for children at once at most (`settle_ahead`): the region may
/// be over its budget by as many pages meanwhile.
const MAX_SETTLING: usize = 64;

/// A forked child's missing page being read by ticket, as the region's own are (`fetch.rs`):
/// the handler goes on serving the parent and the other children meanwhile, and installs it
/// when the read finishes — if the child still reads that page from the copy that was read
/// (`Shared::child_fetched`).
pub(crate) struct ChildFetch {
    /// `ForkChild::id`.
    child: u64,
    page: usize,
    /// The pager's page that was read: the parent's copy or the child's own.
    source: u64,
    /// The thread that faulted last (for SIGBUS if the read fails).
    tid: u32,
    /// Fetched ahead (by this rule of its prefetcher), no thread waiting for it.
    ahead: Option<Mode>,
}

/// Where a child's page is (`ForkChild::pages`). Without a budget only `PARENT` and `OWN`.
pub(crate) mod page {
    /// Not resident in the child: its contents are the pager's copy of the parent's page
    /// (zeros if never written).
    pub(crate) const PARENT: u8 = 0;
    /// Resident in the child, write-protected, equal to the pager's copy of the parent's page:
    /// dropped without a copy.
    pub(crate) const CLEAN: u8 = 1;
    /// Resident in the child, its only copy (written by it, resident at the fork, changed
    /// by the parent in the pager since it was installed, or installed writable because
    /// protecting its pages does not pay: `ForkChild::protection`).
    pub(crate) const OWN: u8 = 2;
    /// Not resident: its contents are in the pager under the child's own page number (zeros
    /// if that was never written).
    pub(crate) const PRIVATE: u8 = 3;
    /// Resident, write-protected, equal to its `PRIVATE` copy.
    pub(crate) const PRIVATE_CLEAN: u8 = 4;
    /// Being dropped by the agent (an `EVICT` sent): then `PARENT`.
    pub(crate) const TO_PARENT: u8 = 5;
    /// Being dropped by the agent: then `PRIVATE` (its copy is stored when `COPIED` comes,
    /// if the request asked for one).
    pub(crate) const TO_PRIVATE: u8 = 6;
    /// Its fork-time contents could not be read before the parent changed them: a touch is a
    /// SIGBUS, never other data.
    pub(crate) const LOST: u8 = 7;
}

/// A child held to a budget, and its agent.
pub(crate) struct Budget {
    /// The handler's end of the agent's socket.
    pub(crate) agent: OwnedFd,
    /// The child's pages are stored in the pager at `slot * region pages + page`.
    slot: u64,
    /// Resident pages at most, and how many there are as far as the handler knows.
    limit: usize,
    resident: usize,
    /// Pages made resident, oldest first (entries may be stale: checked when popped).
    order: VecDeque<u32>,
    /// Requests sent and not dropped yet, oldest first.
    requests: VecDeque<Request>,
    next_seq: u32,
    /// Pages with a write fault waiting for their drop to end (woken then).
    deferred: Vec<usize>,
    /// Missing faults (address, thread) waiting for the agent to catch up (see
    /// [`MAX_REQUESTS`]).
    waiting: Vec<(usize, u32)>,
    /// The agent said hello: it runs, as thread `agent_thread` of process `child_pid`.
    ready: bool,
    child_pid: u32,
    agent_thread: u32,
    /// The agent is gone while the child lives (it closed the socket): no more drops.
    broken: bool,
}

/// Requests a child's agent may have in flight: a child faulting faster than its agent drops
/// waits for it (its next fault is served when a request is done), as a process waits for
/// reclaim, rather than growing past its budget by as much as the agent lags.
pub(crate) const MAX_REQUESTS: usize = 2;

/// An `EVICT` in flight: its pages, which of them the agent copies, and whether it has.
struct Request {
    seq: u32,
    sent: std::time::Instant,
    pages: Vec<(u32, bool)>,
    copied: bool,
}

impl ForkChild {
    fn state(&self, page: usize) -> u8 {
        self.pages[page]
    }

    /// Whether a `TO_PRIVATE` page still waits for its copy from the agent.
    fn awaiting_copy(&self, page: usize) -> bool {
        self.budget.as_ref().is_some_and(|b| {
            b.requests
                .iter()
                .any(|r| !r.copied && r.pages.iter().any(|&(p, c)| c && p as usize == page))
        })
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
    ///
    /// Announced forks go one at a time (bounded: 30 s), so that the agent's socket made for
    /// one reaches that child and no other.
    pub fn prepare_fork(&self) {
        let mut st = self
            .shared
            .await_forks(self.shared.lock(), std::time::Duration::from_secs(30));
        self.shared.prepare_fork(&mut st);
    }

    /// In the parent, after an announced `fork` made child `pid`: where children open their
    /// own descriptors ([`Region::follow_in_child`]), waits until the handler has the child's
    /// (or the child has ended, or 30 s have passed), so that the parent's side changes no
    /// page the child may still need before the handler knows of it. As the kernel holds a
    /// `fork` until the handler has read its event where it sends one.
    pub fn await_child(&self, pid: libc::pid_t) {
        // The child's end of its agent's socket is the child's alone.
        close_raw(&self.shared.agent_fds[1]);
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
    /// on), where the region's faults cannot follow forks by themselves (`Forks::ByChild`):
    /// opens a userfaultfd of the child's own, registers the child's copy of the region and
    /// sends the descriptor to the parent's handler, which serves it from then on as it would
    /// a descriptor from a fork event. Until the handler has it, the parent waits
    /// ([`Region::await_child`]). Allocates nothing and takes no lock (another thread of the
    /// parent may have held any at the fork).
    ///
    /// An error means the child's copy is not served: its pages that were not resident at the
    /// fork would read as zeros. The caller must make the region inaccessible.
    /// Nothing to do (`Ok`) where forks are followed otherwise or not at all.
    ///
    /// Then, where the parent made an agent's socket for this fork, starts the child's agent
    /// (`agent.rs`), through which the parent's handler holds the child's memory to the budget.
    /// (Starting a thread allocates: the C library's allocator is usable in a child.)
    pub fn follow_in_child(&self) -> Result<(), Errno> {
        close_raw(&self.shared.agent_fds[0]);
        let mine = self.shared.agent_fds[1].swap(-1, Ordering::Relaxed);
        let followed = self.follow_by_descriptor();
        if mine >= 0 {
            // SAFETY: this child's end of the socket its parent made for this fork, owned
            // here from now on.
            let socket = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(mine) };
            if followed.is_ok() {
                let base = self.shared.base.page(0) as usize;
                if let Err(e) = agent::start(socket, base, self.shared.pages) {
                    // The handler sees the socket close: this child keeps what it touches.
                    tracing::debug!("a forked child's agent: {e}");
                }
            }
        }
        followed
    }

    /// The descriptor part of [`Region::follow_in_child`].
    fn follow_by_descriptor(&self) -> Result<(), Errno> {
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
            .and_then(|u| u.register(self.shared.base.page(0), len, true).map(|()| u));
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
        close_raw(&self.shared.agent_fds[0]);
        close_raw(&self.shared.agent_fds[1]);
        if self.shared.follows_forks {
            let mut st = self.shared.lock();
            self.shared.fork_done(&mut st);
        }
    }

    /// Gives every live forked child the pages it still lacks and forgets the children:
    /// called before the process exits, which takes the region (and the pager they are served
    /// from) away.
    ///
    /// A fork still pending is waited for first (up to 10 s): the kernel lets a `fork` return
    /// once the handler has read its event, and a parent that leaves at once (Python's
    /// `os._exit` right after `os.fork`) could otherwise go before the handler has made the
    /// child one of its children, and leave it nothing.
    pub fn hand_over_to_children(&self) {
        let mut st = self
            .shared
            .await_forks(self.shared.lock(), std::time::Duration::from_secs(10));
        self.shared.hand_over(&mut st);
    }

    /// Whether forked children are being served this region's pages, or a fork is pending
    /// (see [`Region::hand_over_to_children`]).
    pub fn has_children(&self) -> bool {
        self.shared.child_count.load(Ordering::Acquire) > 0
            || self.shared.forks_pending.load(Ordering::Acquire) > 0
    }
}

impl<T: Transport, D: Disk> Shared<T, D> {
    /// A process forked (`forker`: this process, or one of its children): the new child's
    /// copy of the region faults to `uffd` from now on.
    pub(crate) fn fork_event(&self, st: &mut State<T, D>, uffd: Uffd, forker: Forker) {
        let announced = forker == Forker::Us;
        let mut pages = vec![page::PARENT; self.pages];
        let mut order = VecDeque::new();
        if let Forker::Child(i) = forker {
            self.inherit_from_child(st, i, &uffd, &mut pages);
        }
        if announced && st.forking > 0 {
            if let Some(resident) = &st.fork_resident {
                for (p, state) in pages.iter_mut().enumerate() {
                    if resident[p / 64] & (1 << (p % 64)) != 0 {
                        *state = page::OWN;
                        order.push_back(p as u32);
                    }
                }
            }
            self.fork_done(st);
        } else {
            // A fork nobody announced (a child forking in turn, a raw clone): which pages the
            // new child holds is not known (beyond its forker's, `inherit_from_child`), so any
            // page the parent's side changes is installed in it first. A change between that
            // fork and this event is not (see README).
            tracing::debug!("a fork that was not announced");
        }
        // The agent's socket made for this fork (`prepare_fork`), and a slot for the child's
        // own pages: then the child is held to the budget.
        let socket = if announced {
            self.agent_fds[0].swap(-1, Ordering::Relaxed)
        } else {
            -1
        };
        let budget = if socket >= 0 {
            // SAFETY: the handler's end of the socket made for this fork, owned from here on.
            let agent = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(socket) };
            let slot = self.free_slot(st);
            match slot {
                // No slot after all: the child is not held to a budget. Its agent is told to
                // end quietly (closing the socket alone would have it take the parent for
                // gone and end the child).
                None => agent::let_go(&agent),
                // Its agent holds the child's userfaultfd, so that this process's death
                // leaves the child's faults waiting for the agent to end it, not zero-filled.
                // Without it (the agent gone already) the child runs as before.
                Some(_) => {
                    if let Err(e) = agent::hold(&agent, std::os::fd::AsFd::as_fd(&uffd)) {
                        tracing::debug!("a child's agent was not given its userfaultfd: {e}");
                    }
                }
            }
            slot.map(|slot| Budget {
                agent,
                slot,
                limit: self.child_budget.unwrap_or(st.budget),
                resident: order.len(),
                order,
                requests: VecDeque::new(),
                next_seq: 0,
                deferred: Vec::new(),
                waiting: Vec::new(),
                ready: false,
                child_pid: 0,
                agent_thread: 0,
                broken: false,
            })
        } else {
            None
        };
        self.counters.forks.fetch_add(1, Ordering::Relaxed);
        st.next_child_id += 1;
        st.children.push(ForkChild {
            id: st.next_child_id,
            uffd,
            pages,
            gone: false,
            budget,
            prefetcher: Prefetcher::new(
                MAX_PREFETCH.min(st.prefetch_window / 2),
                MAX_CLUSTER.min(st.prefetch_window / 2),
            ),
            guesses: HashMap::new(),
            guess_order: VecDeque::new(),
            prefetch_seq: 0,
            protection: Protection::default(),
        });
        st.apply_sampling();
        self.child_count.store(st.children.len(), Ordering::Release);
    }

    /// A child `i` forked (a grandchild, `uffd` its descriptor): the grandchild's copy is the
    /// child's, not the parent's. Pages the child holds are in the grandchild's page tables
    /// (its own); pages the child keeps in the pager under its own page numbers are copied
    /// into the grandchild now, as they will change or be deleted with the child's; the rest
    /// are the parent's copy, as for the child. The fork waits in the child until its event
    /// is read, so the child's side has not changed since (its agent's copies sent before
    /// the fork are taken in first).
    fn inherit_from_child(&self, st: &mut State<T, D>, i: usize, uffd: &Uffd, pages: &mut [u8]) {
        self.agent_messages(st, i);
        let child = &st.children[i];
        let slot = child.budget.as_ref().map(|b| b.slot);
        let mut copy = Vec::new();
        for (p, state) in pages.iter_mut().enumerate() {
            *state = match child.state(p) {
                page::OWN | page::PRIVATE_CLEAN => page::OWN,
                page::LOST => page::LOST,
                // Its copy is sent before the page is dropped: one still awaited was resident
                // at the fork, and so is in the grandchild.
                page::TO_PRIVATE if child.awaiting_copy(p) => page::OWN,
                page::PRIVATE | page::TO_PRIVATE => {
                    copy.push(p);
                    page::OWN
                }
                _ => page::PARENT,
            };
        }
        let Some(slot) = slot else {
            return;
        };
        // Read a batch at a time in one pipelined read (the fork waits in the child).
        let mut buf = std::mem::take(&mut st.settle_buf);
        'copying: for chunk in copy.chunks(SETTLE_BATCH) {
            let written: Vec<u64> = chunk
                .iter()
                .map(|&p| self.private(slot, p))
                .filter(|&q| st.pager.is_written(q))
                .collect();
            buf.resize(written.len() * PAGE_SIZE, 0);
            let batch = st.pager.read_many(&written, &mut buf);
            if let Err(e) = &batch {
                tracing::debug!("reading {} pages for a child's child: {e}", written.len());
            }
            let mut k = 0;
            for &p in chunk {
                let private = self.private(slot, p);
                let State {
                    pager, child_buf, ..
                } = &mut *st;
                let read = if !pager.is_written(private) {
                    child_buf.fill(0);
                    Ok(())
                } else if batch.is_ok() {
                    child_buf.copy_from_slice(&buf[k * PAGE_SIZE..(k + 1) * PAGE_SIZE]);
                    k += 1;
                    Ok(())
                } else {
                    // Page by page, each failure said.
                    pager.read(private, child_buf)
                };
                if let Err(e) = read {
                    self.counters.errors.fetch_add(1, Ordering::Relaxed);
                    tracing::error!("page {p} cannot be read for a forked child's child: {e}");
                    pages[p] = page::LOST;
                    continue;
                }
                self.counters.child_copies.fetch_add(1, Ordering::Relaxed);
                match uffd.copy(child_buf, self.base.page(p), false) {
                    // Already there: it was resident in the child at the fork.
                    Ok(()) | Err(Errno::EXIST) => {}
                    // Its memory is gone already: its descriptor says so at the next probe.
                    Err(Errno::SRCH) => break 'copying,
                    Err(e) => {
                        self.counters.errors.fetch_add(1, Ordering::Relaxed);
                        tracing::error!(
                            "page {p} cannot be installed in a forked child's child: {e}"
                        );
                        pages[p] = page::LOST;
                    }
                }
            }
        }
        st.settle_buf = buf;
    }

    /// A child slot no live child uses (1..=`child_slots`).
    fn free_slot(&self, st: &State<T, D>) -> Option<u64> {
        (1..=self.child_slots as u64).find(|&s| {
            !st.children
                .iter()
                .any(|c| c.budget.as_ref().is_some_and(|b| b.slot == s))
        })
    }

    /// Where child slot `slot` keeps its copy of `page` in the pager.
    fn private(&self, slot: u64, page: usize) -> u64 {
        slot * self.pages as u64 + page as u64
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
                (true, Some(u)) => {
                    let forker = if announced {
                        Forker::Us
                    } else {
                        st.children
                            .iter()
                            .position(|c| {
                                c.budget
                                    .as_ref()
                                    .is_some_and(|b| b.child_pid == parent as u32)
                            })
                            .map_or(Forker::Unknown, Forker::Child)
                    };
                    self.fork_event(&mut st, Uffd::from_child(u), forker)
                }
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
        // Every fetch installed first: the child is to have exactly what is resident now.
        self.finish_all(st);
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
            // A socket for the child's agent, when a slot is free for its pages: the child
            // inherits both ends, keeps its own and closes the handler's.
            close_raw(&self.agent_fds[0]);
            close_raw(&self.agent_fds[1]);
            if self.free_slot(st).is_some() {
                match rustix::net::socketpair(
                    rustix::net::AddressFamily::UNIX,
                    rustix::net::SocketType::SEQPACKET,
                    rustix::net::SocketFlags::CLOEXEC | rustix::net::SocketFlags::NONBLOCK,
                    None,
                ) {
                    Ok((ours, theirs)) => {
                        use std::os::fd::IntoRawFd;
                        // The child's end blocks (its agent waits for requests).
                        let _ = rustix::io::ioctl_fionbio(&theirs, false);
                        self.agent_fds[0].store(ours.into_raw_fd(), Ordering::Relaxed);
                        self.agent_fds[1].store(theirs.into_raw_fd(), Ordering::Relaxed);
                    }
                    Err(e) => tracing::warn!("no agent for a forked child: {e}"),
                }
            }
        }
        st.forking += 1;
        self.forks_pending.store(st.forking, Ordering::Release);
    }

    /// Waits, the lock let go meanwhile, until no announced fork is pending or `limit` has
    /// passed, and gives the lock back. A fork pending is bounded anyway: the handler fails
    /// one whose event has not come in 5 s (`serve_children`).
    pub(crate) fn await_forks<'a>(
        &'a self,
        mut st: MutexGuard<'a, State<T, D>>,
        limit: std::time::Duration,
    ) -> MutexGuard<'a, State<T, D>> {
        let since = std::time::Instant::now();
        while st.forking > 0 && since.elapsed() < limit {
            st = self
                .forked
                .wait_timeout(st, std::time::Duration::from_millis(50))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        st
    }

    /// An announced fork happened (its event came), did not happen, or its event will never
    /// come: once none is pending, evictions resume and `release` goes on.
    pub(crate) fn fork_done(&self, st: &mut State<T, D>) {
        st.forking = st.forking.saturating_sub(1);
        self.forks_pending.store(st.forking, Ordering::Release);
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

    /// Before the parent's side changes `page` in the pager: keeps its current contents for
    /// every child that still reads it from there (see `ForkChild`): installed in a child
    /// without a budget, stored under the child's own page number for one with.
    pub(crate) fn settle(&self, st: &mut State<T, D>, page: usize) {
        self.settle_from(st, page, None);
    }

    /// [`Shared::settle`] for each of `pages`, with one pipelined read of those that some
    /// child still reads from the pager, rather than a round trip each: a batch of victims
    /// (`make_room`) or a range given back (`release`).
    pub(crate) fn settle_many(&self, st: &mut State<T, D>, pages: &[usize]) {
        if st.children.is_empty() {
            return;
        }
        let wanted: Vec<u64> = pages
            .iter()
            .filter(|&&p| self.read_by_children(st, p))
            .map(|&p| p as u64)
            .collect();
        if wanted.len() < 2 {
            // One page: its own settle reads it.
            return;
        }
        let mut buf = std::mem::take(&mut st.settle_buf);
        // A bounded buffer, however large the range given back.
        for chunk in wanted.chunks(SETTLE_BATCH) {
            buf.resize(chunk.len() * PAGE_SIZE, 0);
            match st.pager.read_many(chunk, &mut buf) {
                Ok(()) => {
                    for (k, &p) in chunk.iter().enumerate() {
                        let data = &buf[k * PAGE_SIZE..(k + 1) * PAGE_SIZE];
                        self.settle_from(st, p as usize, Some(data));
                    }
                }
                // Each page's own settle tries again, and says what is lost.
                Err(e) => {
                    tracing::debug!("reading {} pages to keep for children: {e}", chunk.len())
                }
            }
        }
        st.settle_buf = buf;
    }

    /// Whether some child still reads `page` from the pager (its contents must be kept for
    /// it before the parent's side changes them).
    fn read_by_children(&self, st: &State<T, D>, page: usize) -> bool {
        st.children.iter().any(|c| {
            !c.gone
                && matches!(
                    (c.state(page), &c.budget),
                    (page::PARENT, _) | (page::TO_PARENT, Some(_))
                )
        }) && st.pager.is_written(page as u64)
    }

    /// Before dirty victims leave while children live: the pager copies some child still
    /// reads are read by ticket (a few at a time, [`MAX_SETTLING`]), and those victims are
    /// taken out of the batch and stay resident (dirty, and to be written back later) until
    /// their read is in and their old contents are kept for the children (`settled`); no
    /// victim waits for that read. What cannot be read this way is read in one pipelined,
    /// waiting read (`settle_many`). `chosen` keeps the victims to evict now.
    pub(crate) fn settle_ahead(&self, st: &mut State<T, D>, chosen: &mut Vec<(usize, bool)>) {
        let mut now = Vec::new();
        let mut later = Vec::new();
        for &(page, sampled) in chosen.iter() {
            if !st.dirty[page] || !self.read_by_children(st, page) {
                continue;
            }
            if sampled {
                // Aside (none is while children live, see `prepare_fork`): read now.
                now.push(page);
                continue;
            }
            if st.settling.contains(&page) {
                later.push(page);
                continue;
            }
            if st.settling.len() < MAX_SETTLING {
                if !st.fetches_out() {
                    st.fetch_progress = std::time::Instant::now();
                }
                match st.pager.start_read(page as u64, SETTLE_TAG | page as u64) {
                    Ok(()) => {
                        st.settling.insert(page);
                        later.push(page);
                        continue;
                    }
                    Err(e) => tracing::debug!("reading page {page} for children: {e}"),
                }
            }
            now.push(page);
        }
        if !later.is_empty() {
            chosen.retain(|(page, _)| !later.contains(page));
            for page in later {
                // Resident again (still write-protected: a write unprotects it, as any).
                st.clock.insert(page as u64);
            }
            self.counters
                .victims_settling
                .fetch_add(1, Ordering::Relaxed);
        }
        self.settle_many(st, &now);
    }

    /// A read of `settle_ahead` finished: the page's old contents are kept for the children
    /// that still read it from the pager. Its current pager copy is what such a child must
    /// see: the parent's side changes it only after settling it (which moves every child off
    /// it), and a child forked since then saw the current one at its fork.
    pub(crate) fn settled(
        &self,
        st: &mut State<T, D>,
        page: usize,
        data: Result<&[u8], &PagerError>,
    ) {
        st.settling.remove(&page);
        match data {
            Ok(bytes) => self.settle_from(st, page, Some(bytes)),
            // Its write-back settles it the waiting way (and says what is lost).
            Err(e) => tracing::debug!("reading page {page} for children: {e}"),
        }
    }

    /// [`Shared::settle`], with the page's current contents in `known` if they were read
    /// already.
    fn settle_from(&self, st: &mut State<T, D>, page: usize, known: Option<&[u8]>) {
        for i in 0..st.children.len() {
            if st.children[i].gone {
                continue;
            }
            let state = st.children[i].state(page);
            if st.children[i].budget.is_none() {
                if state == page::PARENT {
                    self.counters.child_copies.fetch_add(1, Ordering::Relaxed);
                    match known {
                        Some(data) => {
                            self.place_in_child(&mut st.children[i], page, false, Some(data))
                        }
                        None => self.install_in_child(st, i, page, 0),
                    }
                }
                continue;
            }
            match state {
                page::PARENT | page::TO_PARENT => {
                    self.counters.child_copies.fetch_add(1, Ordering::Relaxed);
                    let kept = self.keep_for_child(st, i, page, known);
                    st.children[i].pages[page] = match (kept, state) {
                        (false, _) => page::LOST,
                        (true, page::PARENT) => page::PRIVATE,
                        (true, _) => page::TO_PRIVATE,
                    };
                }
                // Its resident copy is now the only one of the fork-time contents.
                page::CLEAN => st.children[i].pages[page] = page::OWN,
                _ => {}
            }
        }
    }

    /// Copies the pager's `page` (its contents in `known` if read already) to child `i`'s
    /// own page number; false if it cannot be read.
    fn keep_for_child(
        &self,
        st: &mut State<T, D>,
        i: usize,
        page: usize,
        known: Option<&[u8]>,
    ) -> bool {
        let slot = st.children[i].budget.as_ref().expect("a budget").slot;
        let private = self.private(slot, page);
        let State {
            pager, child_buf, ..
        } = st;
        if !pager.is_written(page as u64) {
            // Zeros: the child's own page number was never written (or was deleted).
            return true;
        }
        let copied = match known {
            Some(data) => pager.write(private, data),
            None => pager
                .read(page as u64, child_buf)
                .and_then(|()| pager.write(private, child_buf)),
        };
        match copied {
            Ok(()) => {
                self.counters
                    .child_private_pages
                    .fetch_add(1, Ordering::Relaxed);
                true
            }
            Err(e) => {
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                tracing::error!("page {page} cannot be kept for a forked child: {e}");
                false
            }
        }
    }

    /// Where child `i` reads `page` from in the pager: the parent's copy, or (true) its own.
    fn child_source(&self, child: &ForkChild, page: usize) -> (u64, bool) {
        let own = matches!(child.state(page), page::PRIVATE | page::TO_PRIVATE);
        let source = match (&child.budget, own) {
            (Some(b), true) => self.private(b.slot, page),
            _ => page as u64,
        };
        (source, own)
    }

    /// Installs `page` in child `i` as it reads it (for its thread `tid` if it faulted): the
    /// parent's copy or the child's own, read from the pager now (waiting for it: see
    /// [`Shared::fetch_for_child`] for the way that does not); write-protected for a child
    /// with a budget while that pays, so that its first write is seen.
    pub(crate) fn install_in_child(&self, st: &mut State<T, D>, i: usize, page: usize, tid: u32) {
        let (source, own) = self.child_source(&st.children[i], page);
        let State {
            pager,
            children,
            child_buf,
            ..
        } = st;
        let data = if pager.is_written(source) {
            if let Err(e) = pager.read(source, child_buf) {
                return self.child_unreadable(&children[i], page, tid, &e);
            }
            Some(&child_buf[..])
        } else {
            None
        };
        self.place_in_child(&mut children[i], page, own, data);
    }

    /// A child's page that could not be read from the pager: SIGBUS to its thread `tid`
    /// (if a thread faulted on it), never other data.
    fn child_unreadable(&self, child: &ForkChild, page: usize, tid: u32, e: &PagerError) {
        let addr = self.base.page(page);
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        eprintln!(
            "netram: page {page} of a region (address {:#x}) cannot be read for a forked \
             child: {e}; SIGBUS to its thread {tid}",
            addr as usize
        );
        if tid != 0 {
            // SAFETY: kill(2) takes no pointers; the child's faulting thread is the child's
            // (its id from the fault).
            unsafe { libc::kill(tid as libc::pid_t, libc::SIGBUS) };
        }
        let _ = child.uffd.wake(addr, PAGE_SIZE);
    }

    /// Installs `data` (zeros if `None`: never written) as `page` of `child`, which reads it
    /// from its own copy if `own`; see [`Shared::install_in_child`].
    fn place_in_child(&self, child: &mut ForkChild, page: usize, own: bool, data: Option<&[u8]>) {
        let addr = self.base.page(page);
        let budgeted = child.budget.is_some();
        let protect = budgeted && child.protection.decide();
        let installed = match data {
            Some(bytes) => child.uffd.copy(bytes, addr, protect),
            None if budgeted => child.uffd.copy(&ZEROS, addr, protect),
            None => child.uffd.zeropage(addr),
        };
        match installed {
            Ok(()) => {
                child.pages[page] = match (protect, own) {
                    (false, _) => page::OWN,
                    (true, false) => page::CLEAN,
                    (true, true) => page::PRIVATE_CLEAN,
                };
                if let Some(b) = &mut child.budget {
                    b.resident += 1;
                    b.order.push_back(page as u32);
                    self.counters
                        .child_peak_resident
                        .fetch_max(b.resident as u64, Ordering::Relaxed);
                }
            }
            // Already there (two of its threads faulted on it): whatever it holds is its own.
            Err(rustix::io::Errno::EXIST) => child.pages[page] = page::OWN,
            // Its memory is gone (exited, or exec'd).
            Err(rustix::io::Errno::SRCH) => child.gone = true,
            Err(e) => {
                // The mapping is changing in the child: it faults again.
                tracing::debug!("installing page {page} in a child: {e}");
                let _ = child.uffd.wake(addr, PAGE_SIZE);
            }
        }
    }

    /// A missing fault of child `i`'s thread `tid` on `page`, which it reads from the pager:
    /// its read by ticket is started (or joined, if one is in flight) with those of the
    /// pages its prefetcher proposes, and the handler goes on; each page is installed when
    /// its read finishes (`child_fetched`). A page never written is installed at once.
    fn fetch_for_child(&self, st: &mut State<T, D>, i: usize, page: usize, tid: u32) {
        let (source, _) = self.child_source(&st.children[i], page);
        if !st.pager.is_written(source) {
            return self.install_in_child(st, i, page, tid);
        }
        let child = &mut st.children[i];
        if let Some(mode) = child.guesses.remove(&page) {
            child.prefetcher.hit(mode);
        }
        let (proposed, mode) = child.prefetcher.on_fault(page as u64, self.pages as u64);
        let key = (child.id, page);
        if let Some(f) = st
            .child_fetching
            .get(&key)
            .and_then(|tag| st.child_fetches.get_mut(tag))
        {
            // Another of its threads faulted on it, or it was fetched ahead: the install
            // wakes them.
            if let Some(mode) = f.ahead.take() {
                st.children[i].prefetcher.hit(mode);
            }
            f.tid = tid;
            return;
        }
        if let Err(e) = self.start_child_fetch(st, i, page, source, tid, None) {
            return self.child_unreadable(&st.children[i], page, tid, &e);
        }
        for p in proposed {
            let p = p as usize;
            let child = &st.children[i];
            let absent = matches!(child.state(p), page::PARENT | page::PRIVATE);
            if !absent
                || child.guesses.contains_key(&p)
                || st.child_fetching.contains_key(&(child.id, p))
            {
                continue;
            }
            let (source, _) = self.child_source(child, p);
            if !st.pager.is_written(source) {
                continue;
            }
            if let Err(e) = self.start_child_fetch(st, i, p, source, 0, Some(mode)) {
                tracing::debug!("fetching page {p} ahead for a child: {e}");
            }
        }
    }

    /// Starts the read by ticket of `source` for `page` of child `i`.
    fn start_child_fetch(
        &self,
        st: &mut State<T, D>,
        i: usize,
        page: usize,
        source: u64,
        tid: u32,
        ahead: Option<Mode>,
    ) -> Result<(), PagerError> {
        if !st.fetches_out() {
            st.fetch_progress = std::time::Instant::now();
        }
        st.next_child_fetch += 1;
        let tag = CHILD_TAG | (st.next_child_fetch & (CHILD_TAG - 1));
        st.pager.start_read(source, tag)?;
        self.counters.child_fetches.fetch_add(1, Ordering::Relaxed);
        let child = st.children[i].id;
        st.child_fetches.insert(
            tag,
            ChildFetch {
                child,
                page,
                source,
                tid,
                ahead,
            },
        );
        st.child_fetching.insert((child, page), tag);
        Ok(())
    }

    /// A child's read by ticket finished: its page is installed if the child still lacks it
    /// and reads it from the copy that was read. Otherwise its fault is served afresh: the
    /// parent's side changed the page meanwhile (and kept its old contents for the child
    /// first, `settle`: the read may have brought the new ones), or the page came in another
    /// way, or it was lost.
    pub(crate) fn child_fetched(
        &self,
        st: &mut State<T, D>,
        tag: u64,
        data: Result<&[u8], &PagerError>,
    ) {
        let Some(f) = st.child_fetches.remove(&tag) else {
            // Its child is gone, or the fetch was given up on (`finish_all`).
            return;
        };
        st.child_fetching.remove(&(f.child, f.page));
        let Some(i) = st.children.iter().position(|c| c.id == f.child && !c.gone) else {
            return;
        };
        let child = &st.children[i];
        let (source, own) = self.child_source(child, f.page);
        let reads_it = source == f.source
            && match child.state(f.page) {
                page::PARENT | page::TO_PARENT | page::PRIVATE => true,
                page::TO_PRIVATE => !child.awaiting_copy(f.page),
                _ => false,
            };
        if let Some(mode) = f.ahead {
            // Nobody faulted on it (yet): installed if still wanted, or one in
            // PREFETCH_CHECK kept as a guess.
            let child = &mut st.children[i];
            child.prefetch_seq += 1;
            // Not past the budget a fault would wait at (`child_fault`).
            let full = child.budget.as_ref().is_some_and(|b| {
                b.resident >= b.limit && b.requests.len() >= MAX_REQUESTS && !b.broken
            });
            if !reads_it || data.is_err() || full {
                return;
            }
            if child.prefetch_seq.is_multiple_of(PREFETCH_CHECK as u64) {
                child.guesses.insert(f.page, mode);
                child.guess_order.push_back(f.page);
                while child.guess_order.len() > CHILD_GUESSES {
                    let old = child.guess_order.pop_front().expect("not empty");
                    if let Some(mode) = child.guesses.remove(&old) {
                        child.prefetcher.wasted(mode);
                    }
                }
                return;
            }
            self.counters
                .child_prefetched
                .fetch_add(1, Ordering::Relaxed);
        }
        if !reads_it {
            self.counters
                .child_fetches_redone
                .fetch_add(1, Ordering::Relaxed);
            self.child_missing(st, i, f.page, f.tid);
        } else {
            match data {
                Ok(bytes) => self.place_in_child(&mut st.children[i], f.page, own, Some(bytes)),
                Err(e) => self.child_unreadable(&st.children[i], f.page, f.tid, e),
            }
        }
        self.enforce_budget(st, i);
    }

    /// Gives up on the children's reads by ticket (see `finish_all`): their threads are woken
    /// to fault again.
    pub(crate) fn abandon_child_fetches(&self, st: &mut State<T, D>) {
        st.child_fetching.clear();
        for (_, f) in std::mem::take(&mut st.child_fetches) {
            if let Some(c) = st.children.iter().find(|c| c.id == f.child) {
                let _ = c.uffd.wake(self.base.page(f.page), PAGE_SIZE);
            }
        }
    }

    /// Serves the children's faults and their agents' messages (if `ready`), notices children
    /// whose memory is gone, and forgets them.
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
                close_raw(&self.agent_fds[0]);
            }
        }
        let mut i = 0;
        while i < st.children.len() {
            if ready {
                self.agent_messages(&mut st, i);
                self.resume_waiting(&mut st, i);
            }
            // One turn, as for the parent's (`handler::Round`): a child whose threads fault
            // in a loop does not hold up the parent or its siblings.
            let mut round = handler::Round::new(true);
            while ready && !st.children[i].gone && round.more() {
                let event = st.children[i].uffd.read_event();
                if let Ok(Some(e)) = &event {
                    round.note(e);
                }
                match event {
                    Ok(Some(Event::Pagefault { addr, wp, tid, .. })) => {
                        self.child_fault(&mut st, i, addr, wp, tid)
                    }
                    Ok(Some(Event::Fork(grandchild))) => {
                        self.fork_event(&mut st, grandchild, Forker::Child(i))
                    }
                    Ok(Some(Event::Other(_))) => {}
                    Ok(None) => break,
                    Err(e) => {
                        tracing::debug!("a child's userfaultfd: {e}");
                        st.children[i].gone = true;
                    }
                }
            }
            if probe && !st.children[i].gone && self.agent_vanished(&st.children[i]) {
                // Its socket stays open (a grandchild holds a copy) but nobody answers: the
                // faults waiting for it would wait for good.
                self.agent_lost(&mut st, i);
                self.resume_waiting(&mut st, i);
            }
            if probe && !st.children[i].gone {
                // No event says that a child's memory is gone; an ioctl on it does (ESRCH).
                // Write-protecting its first page as it already is changes nothing it can see.
                let first = self.base.page(0);
                let protected = matches!(
                    st.children[i].state(0),
                    page::CLEAN | page::PRIVATE_CLEAN | page::TO_PARENT | page::TO_PRIVATE
                );
                if let Err(rustix::io::Errno::SRCH) = st.children[i]
                    .uffd
                    .set_write_protect(first, protected, false)
                {
                    st.children[i].gone = true;
                }
            }
            i += 1;
        }
        for i in 0..st.children.len() {
            if st.children[i].gone {
                self.forget_child(&mut st, i);
            }
        }
        st.children.retain(|c| !c.gone);
        self.child_count.store(st.children.len(), Ordering::Release);
        st.apply_sampling();
        if !st.child_fetches.is_empty() {
            // The reads these faults started go out now, and those already answered (from
            // the pager's cache) are installed.
            st.pager.send_queued();
            self.progress_fetches(&mut st);
        }
    }

    /// A child whose memory is gone: its own pages are deleted from the pager.
    fn forget_child(&self, st: &mut State<T, D>, i: usize) {
        // Its reads in flight are dropped when they finish.
        let id = st.children[i].id;
        st.child_fetching.retain(|&(child, _), _| child != id);
        st.child_fetches.retain(|_, f| f.child != id);
        let Some(b) = &st.children[i].budget else {
            return;
        };
        let slot = b.slot;
        let written: Vec<u64> = (0..self.pages)
            .map(|p| self.private(slot, p))
            .filter(|&p| st.pager.is_written(p))
            .collect();
        if let Err(e) = st.pager.discard_many(&written) {
            tracing::warn!("deleting a forked child's pages: {e}");
        }
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
        let state = st.children[i].state(page);
        if wp {
            if let Some(b) = &mut st.children[i].budget {
                match state {
                    page::TO_PARENT | page::TO_PRIVATE => {
                        // Being dropped: the writer waits until it is gone, then faults it
                        // back.
                        b.deferred.push(page);
                        return;
                    }
                    page::PARENT | page::PRIVATE | page::LOST => {
                        // A write fault read after its page was dropped (or, with the agent
                        // gone, one that may still be there): installed as for a missing
                        // fault, which wakes the writer to fault again and write; or found
                        // there after all (then it is the child's own, and writable).
                        if state == page::LOST {
                            return self.child_fault(st, i, addr, false, tid);
                        }
                        self.install_in_child(st, i, page, tid);
                        if st.children[i].state(page) == page::OWN {
                            let _ = st.children[i].uffd.set_write_protect(at, false, true);
                        }
                        return self.enforce_budget(st, i);
                    }
                    // Written: its copy is the only one now.
                    page::CLEAN | page::PRIVATE_CLEAN => {
                        st.children[i].protection.written();
                        st.children[i].pages[page] = page::OWN;
                    }
                    _ => st.children[i].pages[page] = page::OWN,
                }
            }
            // A page installed (or inherited) write-protected: the child's own now, writable.
            // (If that fails, the writer is woken all the same, to fault again rather than
            // sleep.)
            if st.children[i]
                .uffd
                .set_write_protect(at, false, true)
                .is_err()
            {
                let _ = st.children[i].uffd.wake(at, PAGE_SIZE);
            }
            return;
        }
        if let Some(b) = &mut st.children[i].budget {
            if b.resident >= b.limit && b.requests.len() >= MAX_REQUESTS && !b.broken {
                // At its budget with its agent behind: served once a request is done.
                b.waiting.push((addr, tid));
                return;
            }
        }
        self.counters.child_faults.fetch_add(1, Ordering::Relaxed);
        self.child_missing(st, i, page, tid);
        self.enforce_budget(st, i);
    }

    /// A missing fault of child `i`'s thread `tid` on `page`, served by what the page is to
    /// the child.
    fn child_missing(&self, st: &mut State<T, D>, i: usize, page: usize, tid: u32) {
        let at = self.base.page(page);
        match st.children[i].state(page) {
            page::LOST => {
                self.counters.sigbus.fetch_add(1, Ordering::Relaxed);
                eprintln!(
                    "netram: page {page} of a region (address {:#x}) was lost for a forked \
                     child (it could not be read before its parent changed it); SIGBUS to its \
                     thread {tid}",
                    at as usize
                );
                // SAFETY: kill(2) takes no pointers; the faulting thread is the child's.
                unsafe { libc::kill(tid as libc::pid_t, libc::SIGBUS) };
                let _ = st.children[i].uffd.wake(at, PAGE_SIZE);
            }
            page::PARENT | page::TO_PARENT | page::PRIVATE => {
                self.fetch_for_child(st, i, page, tid)
            }
            page::TO_PRIVATE => {
                if st.children[i].awaiting_copy(page) {
                    // Dropped by the agent after it sent the copy, which is waiting here.
                    self.agent_messages(st, i);
                }
                if st.children[i].awaiting_copy(page) {
                    // Not dropped by the agent: the program dropped it itself before the agent
                    // copied it, and reads zeros (which the agent then copies).
                    if st.children[i].uffd.copy(&ZEROS, at, true).is_err() {
                        let _ = st.children[i].uffd.wake(at, PAGE_SIZE);
                    }
                } else {
                    self.fetch_for_child(st, i, page, tid);
                }
            }
            _ => {
                // Its own copy, which it dropped (madvise): zeros, as anonymous memory reads.
                match st.children[i].uffd.zeropage(at) {
                    Ok(()) => st.children[i].pages[page] = page::OWN,
                    Err(_) => {
                        let _ = st.children[i].uffd.wake(at, PAGE_SIZE);
                    }
                }
            }
        }
    }

    /// Asks child `i`'s agent to drop its oldest pages while it holds more than its budget:
    /// pages equal to a copy in the pager are only dropped; the others are write-protected
    /// first and copied by the agent (see `agent.rs`).
    fn enforce_budget(&self, st: &mut State<T, D>, i: usize) {
        let child = &mut st.children[i];
        let Some(b) = &mut child.budget else {
            return;
        };
        while b.ready && !b.broken && b.resident > b.limit && !child.gone {
            let mut victims: Vec<(u32, bool)> = Vec::with_capacity(agent::BATCH);
            // A whole batch at a time: the agent's round trip costs as much as several faults.
            while victims.len() < agent::BATCH {
                let Some(p) = b.order.pop_front() else {
                    break;
                };
                let page = p as usize;
                match child.pages[page] {
                    page::CLEAN => {
                        child.pages[page] = page::TO_PARENT;
                        victims.push((p, false));
                    }
                    page::PRIVATE_CLEAN => {
                        child.pages[page] = page::TO_PRIVATE;
                        victims.push((p, false));
                    }
                    page::OWN => {
                        match child
                            .uffd
                            .set_write_protect(self.base.page(page), true, false)
                        {
                            Ok(()) => {
                                child.pages[page] = page::TO_PRIVATE;
                                victims.push((p, true));
                            }
                            Err(Errno::SRCH) => child.gone = true,
                            // Not protected: it stays, and is not counted any more.
                            Err(e) => {
                                tracing::debug!(
                                    "write-protecting a forked child's page {page}: {e}"
                                );
                                b.resident -= 1
                            }
                        }
                    }
                    // Not resident any more (an older entry of a page dropped since).
                    _ => {}
                }
            }
            if victims.is_empty() {
                // Nothing left to drop that the handler knows of.
                b.resident = b.order.len();
                return;
            }
            let seq = b.next_seq;
            b.next_seq = b.next_seq.wrapping_add(1);
            let mut msg = Vec::with_capacity(agent::HEADER + victims.len() * 4);
            msg.extend_from_slice(&agent::header(agent::EVICT, seq, victims.len() as u32));
            for &(p, copy) in &victims {
                msg.extend_from_slice(&(p | if copy { agent::COPY } else { 0 }).to_ne_bytes());
            }
            match rustix::net::send(&b.agent, &msg, rustix::net::SendFlags::NOSIGNAL) {
                Ok(_) => {
                    b.resident -= victims.len();
                    self.counters
                        .child_drops
                        .fetch_add(victims.len() as u64, Ordering::Relaxed);
                    b.requests.push_back(Request {
                        seq,
                        sent: std::time::Instant::now(),
                        pages: victims,
                        copied: false,
                    });
                }
                Err(e) => {
                    // Not sent: they stay, as they were (protected ones now read-only, which a
                    // write lifts).
                    for &(p, copy) in &victims {
                        child.pages[p as usize] = match (child.pages[p as usize], copy) {
                            (_, true) => page::OWN,
                            (page::TO_PARENT, _) => page::CLEAN,
                            _ => page::PRIVATE_CLEAN,
                        };
                        b.order.push_front(p);
                    }
                    if e != Errno::AGAIN {
                        tracing::debug!("a forked child's agent: {e}");
                        b.broken = true;
                    }
                    return;
                }
            }
        }
    }

    /// Whether `child`'s agent has a request unanswered for a second and its thread is gone
    /// (a stopped child's agent is not: it answers once the child runs again).
    fn agent_vanished(&self, child: &ForkChild) -> bool {
        let Some(b) = &child.budget else {
            return false;
        };
        let stalled = b
            .requests
            .front()
            .is_some_and(|r| r.sent.elapsed() > std::time::Duration::from_secs(1));
        if !stalled || b.broken || b.child_pid == 0 {
            return false;
        }
        let stat = std::fs::read_to_string(format!(
            "/proc/{}/task/{}/stat",
            b.child_pid, b.agent_thread
        ));
        match stat {
            // The state follows the command's closing parenthesis: a zombie or dead thread.
            Ok(s) => s.rsplit_once(')').is_some_and(|(_, rest)| {
                matches!(rest.trim_start().chars().next(), Some('Z' | 'X'))
            }),
            Err(_) => true,
        }
    }

    /// Serves the missing faults that waited for child `i`'s agent, while it has room.
    fn resume_waiting(&self, st: &mut State<T, D>, i: usize) {
        let Some(b) = &mut st.children[i].budget else {
            return;
        };
        if b.waiting.is_empty() || (b.requests.len() >= MAX_REQUESTS && !b.broken) {
            return;
        }
        for (addr, tid) in std::mem::take(&mut b.waiting) {
            if !st.children[i].gone {
                self.child_fault(st, i, addr, false, tid);
            }
        }
    }

    /// Takes every message child `i`'s agent has sent (without waiting).
    fn agent_messages(&self, st: &mut State<T, D>, i: usize) {
        loop {
            let State {
                children,
                agent_buf,
                ..
            } = &mut *st;
            let Some(b) = &mut children[i].budget else {
                return;
            };
            if b.broken {
                return;
            }
            agent_buf.resize(agent::MAX_MESSAGE, 0);
            let n = match rustix::net::recv(
                &b.agent,
                &mut agent_buf[..],
                rustix::net::RecvFlags::DONTWAIT,
            ) {
                Ok((0, _)) => return self.agent_lost(st, i),
                Ok((n, _)) => n,
                Err(Errno::AGAIN | Errno::INTR) => return,
                Err(_) => return self.agent_lost(st, i),
            };
            if n < agent::HEADER {
                return self.agent_lost(st, i);
            }
            let (kind, seq, count) = (
                agent::word(agent_buf, 0),
                agent::word(agent_buf, 1),
                agent::word(agent_buf, 2) as usize,
            );
            match kind {
                agent::HELLO => {
                    b.ready = true;
                    (b.child_pid, b.agent_thread) = (seq, count as u32);
                }
                agent::COPIED => {
                    let Some(r) = b.requests.iter_mut().find(|r| r.seq == seq && !r.copied) else {
                        return self.agent_lost(st, i);
                    };
                    let copies: Vec<usize> = r
                        .pages
                        .iter()
                        .filter(|p| p.1)
                        .map(|p| p.0 as usize)
                        .collect();
                    if copies.len() != count || n != agent::HEADER + count * PAGE_SIZE {
                        return self.agent_lost(st, i);
                    }
                    r.copied = true;
                    let slot = b.slot;
                    for (k, page) in copies.into_iter().enumerate() {
                        let at = agent::HEADER + k * PAGE_SIZE;
                        self.store_private(st, slot, page, at);
                    }
                }
                agent::DROPPED => {
                    let Some(at) = b.requests.iter().position(|r| r.seq == seq && r.copied) else {
                        return self.agent_lost(st, i);
                    };
                    let r = b.requests.remove(at).expect("found");
                    // A page asked for again by a later request (faulted back in and chosen
                    // again meanwhile) stays as that request left it, until that one is done:
                    // it may still be resident, and written once its state says otherwise.
                    let again: Vec<u32> = r
                        .pages
                        .iter()
                        .map(|p| p.0)
                        .filter(|&p| b.requests.iter().any(|l| l.pages.iter().any(|q| q.0 == p)))
                        .collect();
                    let child = &mut children[i];
                    for (p, _) in r.pages {
                        if again.contains(&p) {
                            continue;
                        }
                        let s = &mut child.pages[p as usize];
                        *s = match *s {
                            page::TO_PARENT => page::PARENT,
                            page::TO_PRIVATE => page::PRIVATE,
                            other => other,
                        };
                    }
                    self.wake_deferred(child);
                }
                _ => return self.agent_lost(st, i),
            }
        }
    }

    /// Stores the page the agent copied (at `at` in the agent's buffer) as the child's own.
    fn store_private(&self, st: &mut State<T, D>, slot: u64, page: usize, at: usize) {
        let private = self.private(slot, page);
        let State {
            pager, agent_buf, ..
        } = st;
        let data = &agent_buf[at..at + PAGE_SIZE];
        let stored = if data.iter().all(|&b| b == 0) {
            pager.discard(private)
        } else {
            self.counters
                .child_private_pages
                .fetch_add(1, Ordering::Relaxed);
            pager.write(private, data)
        };
        if let Err(e) = stored {
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
            tracing::error!("a forked child's page {page} cannot be stored: {e}");
        }
    }

    /// Wakes the writers that waited for their page's drop to end.
    fn wake_deferred(&self, child: &mut ForkChild) {
        let Some(b) = &mut child.budget else {
            return;
        };
        let pages = &child.pages;
        let uffd = &child.uffd;
        b.deferred.retain(|&p| {
            let waiting = matches!(pages[p], page::TO_PARENT | page::TO_PRIVATE);
            if !waiting {
                // It faults again: for the page if it is gone, or to write if it is not.
                let _ = uffd.wake(self.base.page(p), PAGE_SIZE);
            }
            waiting
        });
    }

    /// Child `i`'s agent closed its socket (or broke the protocol) while the child lives: no
    /// more drops. Pages it was asked to drop are taken as dropped: if one is still there, a
    /// write to it is a write fault that makes it the child's own again, and a read reads it;
    /// one whose copy never came reads as zeros (the program dropped it itself). Left alone:
    /// such a page that is still there and that the program later drops itself reads as its
    /// pager copy rather than zeros.
    fn agent_lost(&self, st: &mut State<T, D>, i: usize) {
        tracing::debug!("a forked child's agent is gone: the child keeps what it touches");
        let Some(b) = &mut st.children[i].budget else {
            return;
        };
        b.broken = true;
        let slot = b.slot;
        let requests = std::mem::take(&mut b.requests);
        let mut zeros = Vec::new();
        for r in requests {
            for (p, copy) in r.pages {
                let s = &mut st.children[i].pages[p as usize];
                *s = match *s {
                    page::TO_PARENT => page::PARENT,
                    page::TO_PRIVATE => {
                        if copy && !r.copied {
                            zeros.push(self.private(slot, p as usize));
                        }
                        page::PRIVATE
                    }
                    other => other,
                };
            }
        }
        if let Err(e) = st.pager.discard_many(&zeros) {
            tracing::warn!("a forked child's pages: {e}");
        }
        self.wake_deferred(&mut st.children[i]);
    }

    /// Installs every page the children lack and forgets them: the region is going away (the
    /// process exits), and their memory must not depend on it. Pages never written need
    /// nothing: once forgotten, the child's region is plain memory, which reads as zeros.
    ///
    /// The pages are read [`SETTLE_BATCH`] at a time in one pipelined read, not a round trip
    /// each: a program that forks and exits, leaving its child to run (a daemon starting),
    /// hands it its whole region here.
    pub(crate) fn hand_over(&self, st: &mut State<T, D>) {
        let mut buf = std::mem::take(&mut st.settle_buf);
        for i in 0..st.children.len() {
            self.agent_messages(st, i);
            let child = &st.children[i];
            let needed: Vec<usize> = (0..self.pages)
                .filter(|&page| match child.state(page) {
                    page::PARENT | page::TO_PARENT => st.pager.is_written(page as u64),
                    page::PRIVATE | page::TO_PRIVATE => !child.awaiting_copy(page),
                    _ => false,
                })
                .collect();
            for chunk in needed.chunks(SETTLE_BATCH) {
                if st.children[i].gone {
                    break;
                }
                // (page, where it is read from, whether that is the child's own, whether it
                // was ever written there: else it is zeros)
                let sources: Vec<(usize, u64, bool, bool)> = chunk
                    .iter()
                    .map(|&page| {
                        let (source, own) = self.child_source(&st.children[i], page);
                        (page, source, own, st.pager.is_written(source))
                    })
                    .collect();
                let written: Vec<u64> = sources.iter().filter(|s| s.3).map(|s| s.1).collect();
                buf.resize(written.len() * PAGE_SIZE, 0);
                if let Err(e) = st.pager.read_many(&written, &mut buf) {
                    // Page by page, each failure said (and the page left out).
                    tracing::debug!("reading {} pages for a child: {e}", written.len());
                    for &page in chunk {
                        if !st.children[i].gone {
                            self.install_in_child(st, i, page, 0);
                        }
                    }
                    continue;
                }
                let mut k = 0;
                for (page, _, own, was_written) in sources {
                    let data = was_written.then(|| {
                        k += 1;
                        &buf[(k - 1) * PAGE_SIZE..k * PAGE_SIZE]
                    });
                    self.place_in_child(&mut st.children[i], page, own, data);
                }
            }
        }
        // Every page is in each live child: its region becomes plain memory (unregistered
        // first, so that a copy of its userfaultfd left open anywhere — its agent's until it
        // reads this, one a grandchild inherited — cannot hold a later fault there), and its
        // agent may end (closing its socket without this, the agent takes the parent for
        // gone and ends its child).
        for c in st.children.iter().filter(|c| !c.gone) {
            if let Err(e) = c.uffd.unregister(self.base.page(0), self.pages * PAGE_SIZE) {
                tracing::debug!("unregistering a child's region: {e}");
            }
            if let Some(b) = &c.budget {
                agent::let_go(&b.agent);
            }
        }
        st.settle_buf = buf;
        st.children.clear();
        st.child_fetches.clear();
        st.child_fetching.clear();
        self.child_count.store(0, Ordering::Release);
    }
}
