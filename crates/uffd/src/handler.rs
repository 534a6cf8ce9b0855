//! The handler thread: its loop (the region's userfaultfd, the children's, the fork channel,
//! the stop signal, and the connections whose replies fetches in flight wait for), reading
//! fault events and starting their fetches without waiting for them (`fetch.rs`; Anemone §2.2:
//! the faults that wait together go out in one batch per server).

use super::*;

/// Written to the stop eventfd: stop (the region is dropped), or die as if the handler had
/// failed (tests only).
pub(crate) const STOP: u64 = 1;

pub(crate) const DIE: u64 = 2;

/// Written to the same eventfd: look again (the maintenance schedule changed, see
/// [`Region::set_upkeep`]). A multiple of 4, so that any number of them added up by the
/// eventfd leaves [`STOP`] and [`DIE`] readable.
pub(crate) const WAKE: u64 = 4;

/// Events read from one userfaultfd before the loop turns to the others: large enough that the
/// faults of many threads that wait together still go out as one batch. See [`Round`].
pub(crate) const EVENTS_PER_ROUND: usize = 64;

/// What the handler's loop found ready before [`Shared::drain_events`]: whether to read the
/// userfaultfd, and the servers whose replies to read.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ready<'a> {
    pub(crate) events: bool,
    pub(crate) replies: Replies<'a>,
}

/// Which servers' connections to read replies from.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Replies<'a> {
    /// Every one with requests in flight (what was ready is not known: a poll that timed out).
    All,
    /// These (by the pager's server index), which the poll found readable; none if empty.
    From(&'a [usize]),
}

/// One turn of a userfaultfd (the region's, or a forked child's) in the handler's loop: up to
/// [`EVENTS_PER_ROUND`] events, and, while there are children, only until a thread served in
/// this turn faults again.
///
/// A thread that faults in a loop has its next fault queued by the time the last one is
/// served: read until empty, two such threads of the parent (whose faults were then served
/// synchronously while it had children) kept its descriptor full for seconds on end while the
/// child's faults, read after it, waited (`a_program_that_forks_while_its_threads_fault` ran
/// for minutes). Ending the turn at the first thread seen twice gives each faulting thread,
/// the parent's and the children's alike, about one fault served per turn.
pub(crate) struct Round {
    fair: bool,
    events: usize,
    /// The threads served this turn (the first few: enough to see a loop).
    tids: [u32; 8],
    seen: usize,
    repeated: bool,
}

impl Round {
    pub(crate) fn new(fair: bool) -> Self {
        Self {
            fair,
            events: 0,
            tids: [0; 8],
            seen: 0,
            repeated: false,
        }
    }

    /// Whether another event may be read in this turn.
    pub(crate) fn more(&self) -> bool {
        self.events < EVENTS_PER_ROUND && !(self.fair && self.repeated)
    }

    /// Counts an event read (the fault of thread `tid`, if it is one).
    pub(crate) fn note(&mut self, event: &Event) {
        self.events += 1;
        if let Event::Pagefault { tid, .. } = *event {
            if self.tids[..self.seen].contains(&tid) {
                self.repeated = true;
            } else if self.seen < self.tids.len() {
                self.tids[self.seen] = tid;
                self.seen += 1;
            }
        }
    }
}

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

thread_local! {
    /// Set on a region's handler thread: the one that must never wait for the pager.
    static ON_HANDLER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread is a region's handler (see [`Shared::make_room`]).
pub(crate) fn on_handler() -> bool {
    ON_HANDLER.with(std::cell::Cell::get)
}

impl<T: Transport, D: Disk> Shared<T, D> {
    pub(crate) fn run(&self, stop: &OwnedFd) {
        ON_HANDLER.with(|h| h.set(true));
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
        // Whether fetches were in flight when the last events were handled (`fetch.rs`), or
        // victims wait for the pager's room (`evict.rs`): then the loop waits for replies too.
        let mut fetching = false;
        // The maintenance schedule (`upkeep.rs`), and whether a reply it waits for arrived.
        let mut ticker = netram_pager::Ticker::new();
        let mut answered = false;
        // Where events are read to, allocated once: `Inbox::read` allocates nothing then.
        let mut events = Vec::with_capacity(crate::inbox::STASH + sys::MOST_EVENTS);
        loop {
            self.inbox.turn();
            self.upkeep(&mut ticker, std::mem::take(&mut answered));
            let wait_started = std::time::Instant::now();
            let with_children = self.child_count.load(Ordering::Acquire) > 0;
            if spin_next && !with_children && !fetching && self.spin_for_event(wait_started) {
                let ready = Ready {
                    events: true,
                    replies: Replies::From(&[]),
                };
                match self.drain_events(ready, &mut events) {
                    Some(f) => fetching = f,
                    None => return,
                }
                continue;
            }
            // The children's descriptors too, and their agents' sockets, if there are any;
            // then the wait is bounded, to notice children whose memory is gone (no event
            // says so). And the connections whose replies fetches wait for.
            let mut children = Vec::new();
            let mut replies = Vec::new();
            let upkeep = self.upkeep_on();
            // Moves or recovery wait for answers, and the program's share has passed.
            let listening = upkeep && ticker.listens(wait_started);
            if with_children || fetching || listening {
                use std::os::fd::{AsFd, AsRawFd};
                let st = self.lock();
                children.extend(st.children.iter().flat_map(|c| {
                    let agent = c.budget.as_ref().map(|b| b.agent.as_fd().as_raw_fd());
                    std::iter::once(c.uffd.as_fd().as_raw_fd()).chain(agent)
                }));
                fetching = self.awaits_replies(&st);
                if fetching || listening {
                    st.pager.reply_fds_by_server(&mut replies);
                }
            }
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
            let first_reply = first_child + children.len();
            for &fd in &children {
                // SAFETY: a child's descriptor (or its agent's socket) is closed only by this
                // thread (`serve_children`, after the poll) or after it has been joined.
                fds.push(PollFd::from_borrowed_fd(
                    unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) },
                    PollFlags::IN,
                ));
            }
            for &(_, fd) in &replies {
                // SAFETY: a connection of the pager's transport. Poll only looks at it: one
                // closed or reused meanwhile (the maintenance thread reconnecting a server) is
                // at worst a spurious wake-up, after which the loop reads replies through the
                // pager, under the lock, by its current connections.
                fds.push(PollFd::from_borrowed_fd(
                    unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) },
                    PollFlags::IN,
                ));
            }
            // Bounded with children (see above) and with fetches in flight: their replies may
            // be read by another holder of the lock (a program's call into the region), and a
            // fetch that stalls has its server's deadline looked at (`fetch::STALLED`).
            // And by the schedule's next tick.
            let mut bound = std::time::Duration::from_millis(if fetching { 20 } else { 100 });
            let mut bounded = !children.is_empty() || fetching;
            if upkeep {
                let until = ticker.until(wait_started);
                bound = if bounded { bound.min(until) } else { until };
                bounded = true;
            }
            let timeout = rustix::event::Timespec {
                tv_sec: bound.as_secs() as i64,
                tv_nsec: i64::from(bound.subsec_nanos()),
            };
            // With children or fetches, the spin covers their descriptors too: a child's
            // faults wait for this thread as the parent's do, and a reply is as close as a
            // fault.
            let mut polled = Ok(0);
            if spin_next && (with_children || fetching) {
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
                polled = poll(&mut fds, bounded.then_some(&timeout));
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
                let word = u64::from_ne_bytes(word);
                if word & DIE != 0 {
                    // The fault point of the test for a handler that dies.
                    tracing::error!("userfaultfd handler: told to die");
                    return;
                }
                if word & STOP != 0 {
                    guard.armed = false;
                    return;
                }
                // Otherwise a WAKE: the loop looks at the schedule again.
            }
            let timed_out = matches!(polled, Ok(0));
            let readable: Vec<usize> = fds[first_reply..]
                .iter()
                .zip(&replies)
                .filter(|(f, _)| !f.revents().is_empty())
                .map(|(_, &(server, _))| server)
                .collect();
            answered = listening && !readable.is_empty();
            // (A reply counts: the children's fetches wait for replies too.)
            let children_ready = fds[first_child..].iter().any(|f| !f.revents().is_empty());
            let sent = channel.is_some() && !fds[2].revents().is_empty();
            let ready = Ready {
                events: timed_out || !fds[0].revents().is_empty(),
                // A poll that timed out reads everything: a fetch may stall, or another holder
                // of the lock may have taken in part of a reply.
                replies: if timed_out {
                    Replies::All
                } else {
                    Replies::From(&readable)
                },
            };
            drop(fds);
            match self.drain_events(ready, &mut events) {
                Some(f) => fetching = f,
                None => return,
            }
            if let (true, Some(fd)) = (sent, channel) {
                self.receive_children(fd);
            }
            if !children.is_empty() || self.child_count.load(Ordering::Acquire) > 0 {
                self.serve_children(children_ready);
            }
        }
    }

    /// Handles the events that have arrived, a [`Round`]'s worth at most (the descriptor is
    /// non-blocking), then sends the requests they made and installs the fetches that are in;
    /// `None` if the userfaultfd failed, else whether fetches are still in flight.
    ///
    /// A missing fault on a stored page starts its fetch and the next event is read at once
    /// (`fetch.rs`): the faults of several threads that wait together go out in one batch per
    /// server, and the ones that come later join the pipeline rather than wait for it.
    ///
    /// `ready` says what the loop's poll found, so that no system call goes to a descriptor
    /// with nothing to read (at depth 1 a fault paid three that failed with `EAGAIN`: the read
    /// after its event, the replies looked for right after its request went out, the
    /// userfaultfd read again when only its reply had come).
    pub(crate) fn drain_events(&self, ready: Ready<'_>, events: &mut Vec<Event>) -> Option<bool> {
        // One turn: what is left is read after the children's (see `Round`).
        let fair = self.child_count.load(Ordering::Acquire) > 0;
        let mut round = Round::new(fair);
        // (Events the watcher read for this thread wait in the inbox: see `inbox.rs`.)
        let events_ready = ready.events || self.inbox.has_stashed();
        while events_ready && round.more() {
            // Without children a turn ends only at its bound, so a turn's worth is read at
            // once; with them, one at a time, since the turn may end at any event.
            let want = if fair {
                1
            } else {
                EVENTS_PER_ROUND - round.events
            };
            match self.inbox.read(&self.uffd, events, want) {
                Ok(n) => {
                    for event in events.drain(..) {
                        round.note(&event);
                        self.dispatch(&mut self.lock(), event)
                    }
                    if n < want {
                        // None was left (see `read_events`).
                        break;
                    }
                }
                Err(e) => {
                    tracing::error!("userfaultfd handler: read: {e}");
                    self.finish_all(&mut self.lock());
                    return None;
                }
            }
        }
        let mut st = self.lock();
        // Faults that came while a fork was pending, once it is not (or once it has been
        // pending too long: then it failed unseen).
        if !st.deferred.is_empty() {
            self.expire_fork(&mut st);
        }
        self.serve_deferred(&mut st);
        if st.fetches_out() {
            st.pager.send_queued();
            // The room the fetches need is made while their requests are on the wire, not
            // after their pages are installed: on the faulting thread's CPU, eviction after
            // the install delays its wake-up.
            let keep = st.budget.saturating_sub(st.fetching.len());
            self.make_room(&mut st, keep);
            self.progress_fetches(&mut st, ready.replies);
            if st.forking > 0 && st.fetching.is_empty() && st.settling.is_empty() {
                // A thread about to fork waits for these (`prepare_fork`).
                self.forked.notify_all();
            }
        } else if self.over_budget(&st) {
            // Victims left for want of the pager's room: acknowledgements may have returned
            // some (`make_room` reads them).
            let keep = st.budget;
            self.make_room(&mut st, keep);
        }
        // Faults held past the budget, once the room made above allows.
        self.serve_deferred(&mut st);
        self.delete_leftovers(&mut st);
        if st.pager.sends_waiting() {
            // Requests the pager queued for want of credit (deletes of pages given back,
            // write-backs) go out as the replies in flight free it; nothing else here may
            // send them once no fetch is out (a forked child's pages given back stayed on the
            // server for good so, ~1 run in 40 of `pages_given_back_after_a_fork…`).
            if let Err(e) = st.pager.poll() {
                tracing::debug!("taking in replies for queued requests: {e}");
            }
            st.pager.send_queued();
        }
        Some(self.awaits_replies(&st))
    }

    /// One event: a missing fault on a stored page starts (or joins) a fetch; a fork waits
    /// for every fetch in flight first; anything else is handled at once.
    fn dispatch(&self, st: &mut State<T, D>, event: Event) {
        match event {
            Event::Pagefault {
                addr,
                write,
                wp: false,
                tid,
            } => {
                let page = (addr - self.base.0.as_ptr() as usize) / PAGE_SIZE;
                if page < self.pages
                    && (self.holds_faults(st) || !st.deferred.is_empty())
                    && st.forking == 0
                {
                    // Past the budget's margin, servers behind: the fault waits for room,
                    // the handler does not (behind faults already held, in order).
                    self.counters.faults.fetch_add(1, Ordering::Relaxed);
                    self.counters.faults_held.fetch_add(1, Ordering::Relaxed);
                    st.deferred.push((page, write, tid));
                    return;
                }
                if page < self.pages && self.fetchable(st, page) {
                    return self.start_fetch(st, page, write, tid);
                }
            }
            // An announced fork started none (`prepare_fork`); another may have fetches out,
            // which the child must not miss.
            Event::Fork(_) if !st.fetching.is_empty() || !st.settling.is_empty() => {
                self.finish_all(st)
            }
            Event::Pagefault { .. } | Event::Fork(_) | Event::Other(_) => {}
        }
        self.handle(st, event)
    }

    /// Whether the region holds more pages than its budget, with victims to evict (not while
    /// a fork is pending, when nothing leaves).
    fn over_budget(&self, st: &State<T, D>) -> bool {
        st.forking == 0 && st.clock.len() > st.budget
    }

    /// Whether the loop waits for replies as well as events (and so with a bound): fetches
    /// in flight, victims that wait for acknowledgements to return the pager's slots, or
    /// pages to delete once their write-back is in (whose acknowledgement another holder of
    /// the lock may have taken in: the next turn deletes them then), or requests the pager
    /// queued for want of credit (sent as replies free it, `drain_events`).
    fn awaits_replies(&self, st: &State<T, D>) -> bool {
        st.fetches_out()
            || !st.undeleted.is_empty()
            || !st.released.is_empty()
            || !st.deferred.is_empty()
            || st.pager.sends_waiting()
            || (self.over_budget(st) && st.pager.awaits_replies())
    }

    /// Polls the userfaultfd without sleeping for up to the spin; true once an event is
    /// waiting. Sleeping and being woken costs about as much as a fault here.
    pub(crate) fn spin_for_event(&self, started: std::time::Instant) -> bool {
        while started.elapsed() < self.spin {
            if sys::readable_within(&self.uffd, std::time::Duration::ZERO) {
                return true;
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
            Event::Fork(child) => return self.fork_event(st, child, fork::Forker::Us),
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
                        // (A dirty page protected is a victim that stayed resident, see
                        // `settle_ahead`: not a fetched page written.)
                        if !st.dirty[page] {
                            self.counters.first_writes.fetch_add(1, Ordering::Relaxed);
                            st.protection.written();
                        }
                        st.dirty[page] = true;
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

#[cfg(test)]
mod round_tests {
    use super::*;

    fn fault(tid: u32) -> Event {
        Event::Pagefault {
            addr: 0,
            write: false,
            wp: false,
            tid,
        }
    }

    /// With children a turn ends at the first thread served twice; without, only the bound.
    #[test]
    fn a_turn_ends_at_a_thread_seen_again_only_with_children() {
        let mut fair = Round::new(true);
        for tid in [1, 2, 3] {
            assert!(fair.more());
            fair.note(&fault(tid));
        }
        assert!(fair.more(), "three different threads");
        fair.note(&fault(2));
        assert!(!fair.more(), "thread 2 faulted again in the turn");

        let mut plain = Round::new(false);
        for _ in 0..EVENTS_PER_ROUND {
            assert!(plain.more());
            plain.note(&fault(7));
        }
        assert!(!plain.more(), "{EVENTS_PER_ROUND} events at most");
    }
}
