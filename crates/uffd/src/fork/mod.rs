//! `fork` under paging: a forked child keeps its copy of the region as it was at the fork, its
//! missing pages served by the parent's handler from the pager, and the parent's side installs
//! a page in every child that lacks it before changing it (Linux's fork semantics kept across
//! paging; Anemone §2.2's transparency to unmodified programs). Descriptors come from the
//! kernel's fork events (root) or from the child itself over a socket ([`Forks::ByChild`]).
//!
//! Here: the children's bookkeeping (`ForkChild`, the page states), announced forks and the
//! descriptors of new children. The rest by concern: `child.rs` serves a child's faults,
//! `settle.rs` keeps what a child still reads before the parent's side changes it,
//! `budget.rs` holds a child to its budget through its agent (`agent.rs`), `handover.rs`
//! gives the children their pages when the parent leaves.

use super::*;

mod budget;
mod child;
mod handover;
mod settle;

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
    /// The agent's socket of a child without a budget (no slot was free, `--child-mem
    /// unlimited`): its agent only holds the child's userfaultfd and ends the child if this
    /// process dies without handing it its pages (`agent.rs`). A child with a budget has it in
    /// `budget.agent`.
    pub(crate) watch: Option<OwnedFd>,
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
        let st = self
            .shared
            .await_forks(self.shared.lock(), std::time::Duration::from_secs(30));
        drop(self.shared.prepare_fork(st));
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
            self.give_sampled_to_child(st, &uffd, &mut pages);
        }
        // The agent's socket made for this fork (`prepare_fork`), and a slot for the child's
        // own pages: then the child is held to the budget. Without a slot, the agent only
        // watches: it ends the child if this process dies without handing it its pages.
        let socket = if announced {
            self.agent_fds[0].swap(-1, Ordering::Relaxed)
        } else {
            -1
        };
        let (budget, watch) = if socket >= 0 {
            // SAFETY: the handler's end of the socket made for this fork, owned from here on.
            let agent = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(socket) };
            // Its agent holds the child's userfaultfd, so that this process's death leaves the
            // child's faults waiting for the agent to end it, not zero-filled. Without it (the
            // agent gone already) the child runs as before.
            if let Err(e) = agent::hold(&agent, std::os::fd::AsFd::as_fd(&uffd)) {
                tracing::debug!("a child's agent was not given its userfaultfd: {e}");
            }
            let slot = self.free_slot(st);
            if let Some(slot) = slot {
                self.clear_slot(st, slot);
            }
            match slot {
                None => (None, Some(agent)),
                Some(slot) => (
                    Some(Budget {
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
                    }),
                    None,
                ),
            }
        } else {
            (None, None)
        };
        self.counters.forks.fetch_add(1, Ordering::Relaxed);
        st.next_child_id += 1;
        st.children.push(ForkChild {
            id: st.next_child_id,
            uffd,
            pages,
            gone: false,
            budget,
            watch,
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

    /// Pages sampled aside (in the shadow) when a fork nobody announced came: nothing put them
    /// back first (`prepare_fork` does), so the new child's copy of the region lacks them and
    /// the pager may hold an older copy of a dirty one, or none. Each still the parent's copy
    /// to the child is installed in it from the shadow, its own from then on; one that cannot
    /// be is lost to it (SIGBUS when touched, never older data).
    fn give_sampled_to_child(&self, st: &State<T, D>, uffd: &Uffd, pages: &mut [u8]) {
        let Some(shadow) = self.shadow else {
            return;
        };
        for (p, state) in pages.iter_mut().enumerate() {
            if *state != page::PARENT || !st.clock.is_sampled(p as u64) {
                continue;
            }
            // SAFETY: a sampled page is present in the shadow, touched only by this handler,
            // which holds the state.
            let contents =
                unsafe { std::slice::from_raw_parts(shadow.page(p).cast::<u8>(), PAGE_SIZE) };
            match uffd.copy(contents, self.base.page(p), false) {
                Ok(()) | Err(Errno::EXIST) => *state = page::OWN,
                // The child is gone already: nothing to give.
                Err(Errno::SRCH) => return,
                Err(e) => {
                    self.counters.errors.fetch_add(1, Ordering::Relaxed);
                    tracing::error!("page {p}, sampled aside, cannot be given to a child: {e}");
                    *state = page::LOST;
                }
            }
        }
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
                .filter(|&q| st.holds(q))
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
    pub(crate) fn prepare_fork<'a>(
        &'a self,
        mut st: MutexGuard<'a, State<T, D>>,
    ) -> MutexGuard<'a, State<T, D>> {
        if !self.follows_forks {
            return st;
        }
        let first = st.forking == 0;
        // Announced from here: no fetch starts, a fault on a stored page waits for the fork
        // (`serve_deferred`), nothing is evicted; but this thread's own (the `atfork` handlers
        // run between this and the fork) are served, or its fork would wait for itself.
        st.forking += 1;
        st.forking_tid = Some(rustix::thread::gettid().as_raw_nonzero().get() as u32);
        self.forks_pending.store(st.forking, Ordering::Release);
        // Every fetch of the region's installed first, the child is to have exactly what is
        // resident now: by the handler's loop, which owns the sockets, while this thread waits
        // with the lock let go. Only a fetch that outlasts the bound is waited for here.
        st = self.await_own_fetches(st, std::time::Duration::from_secs(10));
        if !st.fetching.is_empty() || !st.settling.is_empty() {
            self.finish_all(&mut st);
        }
        // No sampling while a child lives: moving a page aside (`UFFDIO_MOVE`) after a fork
        // was seen to leave the shadow's page missing (the handler then faulted on it and
        // waited for itself). Resumed once the children are gone (`serve_children`).
        st.clock.set_max_samples(0);
        // Sampled pages wait in the shadow, which a child does not inherit: back into the
        // region, where the child gets them with everything else resident.
        for page in 0..self.pages {
            if st.clock.is_sampled(page as u64) {
                self.put_back(&mut st, page);
            }
        }
        if first {
            let mut resident = vec![0u64; self.pages.div_ceil(64)];
            for page in 0..self.pages {
                if st.clock.is_resident(page as u64) {
                    resident[page / 64] |= 1 << (page % 64);
                }
            }
            st.fork_resident = Some(resident);
            st.forking_since = Some(std::time::Instant::now());
            // A socket for the child's agent (held to a budget when a slot is free for its
            // pages, else only watching for this process's death): the child inherits both
            // ends, keeps its own and closes the handler's.
            close_raw(&self.agent_fds[0]);
            close_raw(&self.agent_fds[1]);
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
        st
    }

    /// Waits, the lock let go meanwhile, until none of the region's own fetches and settling
    /// reads is in flight or `limit` has passed (the handler's loop finishes them and says
    /// so), and gives the lock back. The children's fetches go on: they change nothing of the
    /// region's.
    fn await_own_fetches<'a>(
        &'a self,
        mut st: MutexGuard<'a, State<T, D>>,
        limit: std::time::Duration,
    ) -> MutexGuard<'a, State<T, D>> {
        let since = std::time::Instant::now();
        while (!st.fetching.is_empty() || !st.settling.is_empty()) && since.elapsed() < limit {
            st = self
                .forked
                .wait_timeout(st, std::time::Duration::from_millis(5))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        st
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

    /// A fork announced 5 s ago whose event has not come failed unseen: it is pending no
    /// more (the faults deferred over it are served).
    pub(crate) fn expire_fork(&self, st: &mut State<T, D>) {
        if st
            .forking_since
            .is_some_and(|t| t.elapsed() > std::time::Duration::from_secs(5))
        {
            tracing::warn!("a fork announced 5 s ago never happened");
            st.forking = 1;
            self.fork_done(st);
            close_raw(&self.agent_fds[0]);
        }
    }

    /// An announced fork happened (its event came), did not happen, or its event will never
    /// come: once none is pending, evictions resume and `release` goes on.
    pub(crate) fn fork_done(&self, st: &mut State<T, D>) {
        st.forking = st.forking.saturating_sub(1);
        self.forks_pending.store(st.forking, Ordering::Release);
        if st.forking == 0 {
            st.fork_resident = None;
            st.forking_since = None;
            st.forking_tid = None;
            self.forked.notify_all();
            if !st.deferred.is_empty() {
                // Its loop serves them (`serve_deferred`), and may be asleep without deadline.
                let _ = rustix::io::write(&*self.wake, &handler::WAKE.to_ne_bytes());
            }
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
}
