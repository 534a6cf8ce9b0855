//! The handler thread: its loop (the region's userfaultfd, the children's, the fork channel,
//! the stop signal), reading fault events and batching the missing faults of several threads
//! into one pipelined fetch (Anemone §2.2: one round trip for the faults that wait together).

use super::*;

/// Written to the stop eventfd: stop (the region is dropped), or die as if the handler had
/// failed (tests only).
pub(crate) const STOP: u64 = 1;

pub(crate) const DIE: u64 = 2;

/// See `Shared::run`.
pub(crate) struct DeadHandler<'a> {
    base: Base,
    len: usize,
    uffd: &'a Uffd,
    armed: bool,
}

impl Drop for DeadHandler<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        tracing::error!("userfaultfd handler gone: the region is made inaccessible");
        // SAFETY: the region's own mapping, alive until the Region is dropped (which joins
        // this thread first); no memory is freed, only access is removed.
        let _ = unsafe {
            rustix::mm::mprotect(
                self.base.0.as_ptr().cast(),
                self.len,
                rustix::mm::MprotectFlags::empty(),
            )
        };
        let _ = self.uffd.wake(self.base.page(0), self.len);
    }
}

impl<T: Transport, D: Disk> Shared<T, D> {
    pub(crate) fn run(&self, stop: &OwnedFd) {
        // However this thread ends other than by the region's drop (an error, a panic), the
        // guard makes the region inaccessible and wakes every waiting thread: they die of
        // SIGSEGV instead of waiting forever for a handler that is gone.
        let mut guard = DeadHandler {
            base: self.base,
            len: self.pages * PAGE_SIZE,
            uffd: &self.uffd,
            armed: true,
        };
        // Whether to spin before sleeping: only while faults come closer together than the
        // spin (a scan), not when the program computes between faults.
        let mut spin_next = !self.spin.is_zero();
        loop {
            let wait_started = std::time::Instant::now();
            let with_children = self.child_count.load(Ordering::Acquire) > 0;
            if spin_next && !with_children && self.spin_for_event(wait_started) {
                self.drain_events();
                continue;
            }
            // The children's descriptors too, and their agents' sockets, if there are any;
            // then the wait is bounded, to notice children whose memory is gone (no event
            // says so).
            let children = if self.child_count.load(Ordering::Acquire) > 0 {
                use std::os::fd::{AsFd, AsRawFd};
                self.lock()
                    .children
                    .iter()
                    .flat_map(|c| {
                        let agent = c.budget.as_ref().map(|b| b.agent.as_fd().as_raw_fd());
                        std::iter::once(c.uffd.as_fd().as_raw_fd()).chain(agent)
                    })
                    .collect()
            } else {
                Vec::new()
            };
            let mut fds = vec![
                PollFd::new(&self.uffd, PollFlags::IN),
                PollFd::new(stop, PollFlags::IN),
            ];
            // Descriptors of children that open their own (see `Region::follow_in_child`).
            let channel = self
                .fork_channel
                .as_ref()
                .map(|c| c.receiver.load(Ordering::Relaxed))
                .filter(|&fd| fd >= 0);
            if let Some(fd) = channel {
                // SAFETY: the handler's end of the channel, closed only in a forked child
                // (where this thread does not exist).
                fds.push(PollFd::from_borrowed_fd(
                    unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) },
                    PollFlags::IN,
                ));
            }
            let first_child = fds.len();
            for &fd in &children {
                // SAFETY: a child's descriptor (or its agent's socket) is closed only by this
                // thread (`serve_children`, after the poll) or after it has been joined.
                fds.push(PollFd::from_borrowed_fd(
                    unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) },
                    PollFlags::IN,
                ));
            }
            let timeout = rustix::event::Timespec {
                tv_sec: 0,
                tv_nsec: 100_000_000,
            };
            // With children, the spin covers their descriptors and agents too: a child's
            // faults wait for this thread as the parent's do.
            let mut polled = Ok(0);
            if spin_next && with_children {
                let zero = rustix::event::Timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                };
                while wait_started.elapsed() < self.spin {
                    polled = poll(&mut fds, Some(&zero));
                    if !matches!(polled, Ok(0)) {
                        break;
                    }
                    std::hint::spin_loop();
                }
            }
            if matches!(polled, Ok(0)) {
                polled = poll(&mut fds, (!children.is_empty()).then_some(&timeout));
            }
            spin_next = !self.spin.is_zero() && wait_started.elapsed() <= self.spin * 2;
            match polled {
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => {
                    tracing::error!("userfaultfd handler: poll: {e}");
                    return;
                }
            }
            if !fds[1].revents().is_empty() {
                let mut word = [0u8; 8];
                let _ = rustix::io::read(stop, &mut word);
                if u64::from_ne_bytes(word) == DIE {
                    // The fault point of the test for a handler that dies.
                    tracing::error!("userfaultfd handler: told to die");
                    return;
                }
                guard.armed = false;
                return;
            }
            let children_ready = fds[first_child..].iter().any(|f| !f.revents().is_empty());
            let sent = channel.is_some() && !fds[2].revents().is_empty();
            drop(fds);
            if !self.drain_events() {
                return;
            }
            if let (true, Some(fd)) = (sent, channel) {
                self.receive_children(fd);
            }
            if !children.is_empty() || self.child_count.load(Ordering::Acquire) > 0 {
                self.serve_children(children_ready);
            }
        }
    }

    /// Handles every event that has arrived (the descriptor is non-blocking); false if the
    /// userfaultfd failed.
    ///
    /// Faults of several threads that wait at once are served together: a fault on a page
    /// that must be fetched waits (in `waiting`) while the events behind it are read, and all
    /// such pages are fetched with one pipelined `read_many` — one round trip for all of them
    /// rather than one each, in turn. A second fault on a page already waiting is served by
    /// the same install, which wakes every thread waiting on that page.
    pub(crate) fn drain_events(&self) -> bool {
        loop {
            match self.uffd.read_event() {
                Ok(Some(event)) => {
                    let mut st = self.lock();
                    if !self.wait_for_fetch(&mut st, &event) {
                        self.fetch_waiting(&mut st);
                        self.handle(&mut st, event);
                    } else if st.waiting.len() >= FETCH_BATCH {
                        self.fetch_waiting(&mut st);
                    }
                }
                Ok(None) => {
                    self.fetch_waiting(&mut self.lock());
                    return true;
                }
                Err(e) => {
                    tracing::error!("userfaultfd handler: read: {e}");
                    self.fetch_waiting(&mut self.lock());
                    return false;
                }
            }
        }
    }

    /// Puts a missing fault on a page to be fetched from the pager into `waiting`; false for
    /// any other event (handled at once, after the waiting ones). Not while forks are pending
    /// or children live: their bookkeeping goes fault by fault.
    pub(crate) fn wait_for_fetch(&self, st: &mut State<T, D>, event: &Event) -> bool {
        let Event::Pagefault {
            addr,
            write,
            wp: false,
            tid,
        } = *event
        else {
            return false;
        };
        let page = (addr - self.base.0.as_ptr() as usize) / PAGE_SIZE;
        if !self.fetchable(st, page) {
            return false;
        }
        if st.waiting.iter().any(|w| w.0 == page) {
            // Another thread's fault on the same page: its install wakes this one too.
            self.counters.faults.fetch_add(1, Ordering::Relaxed);
            self.counters
                .already_present
                .fetch_add(1, Ordering::Relaxed);
            return true;
        }
        st.waiting.push((page, write, tid));
        true
    }

    /// Whether a missing fault on `page` is served by fetching it from the pager, and may wait
    /// for others to be fetched with it.
    pub(crate) fn fetchable(&self, st: &State<T, D>, page: usize) -> bool {
        let p = page as u64;
        st.forking == 0
            && st.children.is_empty()
            && !st.clock.is_sampled(p)
            && !st.clock.is_resident(p)
            && !st.prefetched.contains_key(&p)
            && st.pager.is_written(p)
    }

    /// Fetches and installs every page in `waiting`: one alone the usual way (`missing`,
    /// with its prefetching), several with one `read_many`.
    pub(crate) fn fetch_waiting(&self, st: &mut State<T, D>) {
        match st.waiting.len() {
            0 => {}
            1 => {
                let (page, write, tid) = st.waiting.pop().expect("one");
                self.missing(st, page, write, tid);
            }
            _ => {
                let mut waiting = std::mem::take(&mut st.waiting);
                // The lock was let go between events: a page the program has released (or
                // that a fork froze) meanwhile is served the usual way.
                let mut i = 0;
                while i < waiting.len() {
                    let (page, write, tid) = waiting[i];
                    if self.fetchable(st, page) {
                        i += 1;
                    } else {
                        waiting.swap_remove(i);
                        self.missing(st, page, write, tid);
                    }
                }
                let n = waiting.len();
                if n == 0 {
                    st.waiting = waiting;
                    return;
                }
                let pages: Vec<u64> = waiting.iter().map(|w| w.0 as u64).collect();
                let mut buf = std::mem::take(&mut st.wbuf);
                buf.resize(n * PAGE_SIZE, 0);
                if st.pager.read_many(&pages, &mut buf).is_err() {
                    // One by one, so that each page that cannot be read is named (SIGBUS).
                    for &(page, write, tid) in &waiting {
                        self.missing(st, page, write, tid);
                    }
                } else {
                    self.counters.faults.fetch_add(n as u64, Ordering::Relaxed);
                    self.counters
                        .batched_fetches
                        .fetch_add(n as u64, Ordering::Relaxed);
                    for (i, &(page, write, _)) in waiting.iter().enumerate() {
                        let data = &buf[i * PAGE_SIZE..(i + 1) * PAGE_SIZE];
                        self.install_fetched(st, page, write, data);
                    }
                    let keep = st.budget;
                    self.make_room(st, keep);
                }
                st.wbuf = buf;
                st.waiting = waiting;
                st.waiting.clear();
            }
        }
    }

    /// Polls the userfaultfd without sleeping for up to the spin; true once an event is
    /// waiting. Sleeping and being woken costs about as much as a fault here.
    pub(crate) fn spin_for_event(&self, started: std::time::Instant) -> bool {
        let mut fds = [PollFd::new(&self.uffd, PollFlags::IN)];
        while started.elapsed() < self.spin {
            let zero = rustix::event::Timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            if let Ok(n) = poll(&mut fds, Some(&zero)) {
                if n > 0 {
                    return true;
                }
            }
            std::hint::spin_loop();
        }
        false
    }

    pub(crate) fn handle(&self, st: &mut State<T, D>, event: Event) {
        let (addr, write, wp, tid) = match event {
            Event::Pagefault {
                addr,
                write,
                wp,
                tid,
            } => (addr, write, wp, tid),
            Event::Fork(child) => return self.fork_event(st, child, true),
            // Not asked for (no remap, remove or unmap events).
            Event::Other(e) => return tracing::debug!("userfaultfd event {e} ignored"),
        };
        let page = (addr - self.base.0.as_ptr() as usize) / PAGE_SIZE;
        debug_assert!(page < self.pages);
        let addr = self.base.page(page);
        match wp {
            false => self.missing(st, page, write, tid),
            true if st.clock.is_sampled(page as u64) => {
                // A write to a clean page that was sampled after the fault was raised: the
                // page is aside now. Dirty from now on; the woken writer faults again and gets
                // it back writable.
                self.counters.first_writes.fetch_add(1, Ordering::Relaxed);
                st.dirty[page] = true;
                let _ = self.uffd.wake(addr, PAGE_SIZE);
            }
            true if st.clock.is_resident(page as u64) => {
                // The first write to a fetched page, which was installed write-protected: from
                // now on it differs from its remote copy.
                match self.uffd.set_write_protect(addr, false, true) {
                    Ok(()) => {
                        self.counters.first_writes.fetch_add(1, Ordering::Relaxed);
                        st.dirty[page] = true;
                        st.written_after_fetch += 1;
                    }
                    // The mapping is changing (a fork copying it): the writer, woken, faults
                    // again and is served then. (Left asleep, it would never be.)
                    Err(rustix::io::Errno::AGAIN) => {
                        self.counters.retried.fetch_add(1, Ordering::Relaxed);
                        let _ = self.uffd.wake(addr, PAGE_SIZE);
                    }
                    Err(e) => {
                        tracing::error!("unprotecting page {page}: {e}");
                        self.counters.errors.fetch_add(1, Ordering::Relaxed);
                        let _ = self.uffd.wake(addr, PAGE_SIZE);
                    }
                }
            }
            true => {
                // A write that raced with the page's eviction: an eviction completes before the
                // next event is read, so the page is gone now, and the woken writer faults
                // again as a missing page.
                self.counters
                    .write_protect_faults
                    .fetch_add(1, Ordering::Relaxed);
                let _ = self.uffd.wake(addr, PAGE_SIZE);
            }
        }
    }
}
