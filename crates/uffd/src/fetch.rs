//! Fetches in flight: a missing fault on a page stored in the pager starts a read by ticket
//! (`netram_pager`'s `ticket.rs`) for it and for the pages the prefetcher proposes, and the
//! handler goes back to its loop; the page is installed when its reply is in, whichever thread
//! holds the region's lock then. So the faults of several threads are in flight together, a
//! fault never waits for another page's round trip, and a second fault on a page being fetched
//! waits for that fetch rather than starting another (Anemone §2.2: each fault is its own
//! request; the pipeline, not a thread per fault, hides the round trips).
//!
//! The lock is held only while a fetch starts and while one is installed, never across the
//! round trip. What still waits: a fork (its bookkeeping wants every fetch installed first, see
//! `finish_all`). A server that hangs is found by the
//! pager's own reply timeout (`Pager::expire`), asked once fetches have had no reply for
//! [`STALLED`]: its reads then go to another copy, without waiting.

use super::*;

/// Fetches with no reply for this long have the pager look for requests past its reply
/// timeout (before, they were waited for under the transport's).
pub(crate) const STALLED: std::time::Duration = std::time::Duration::from_millis(200);

/// A page being read by ticket.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fetch {
    /// A thread faulted on it (the last one's id, for SIGBUS) and whether any wrote; `None`
    /// while it is only fetched ahead.
    pub(crate) fault: Option<(bool, u32)>,
    /// The prefetcher's rule that proposed it, if it was fetched ahead.
    pub(crate) ahead: Option<Mode>,
    /// The program gave the page back meanwhile (`release`): what arrives is stale.
    pub(crate) released: bool,
}

impl<T: Transport, D: Disk> Shared<T, D> {
    /// Whether a missing fault on `page` is served by a fetch in flight: a page stored in the
    /// pager, neither resident nor aside, and no fork pending (a fork waits for every fetch to
    /// be installed, see `fork/`). Forked children alive do not matter: a fetch leaves the
    /// pager's copy, which they read, as it is.
    pub(crate) fn fetchable(&self, st: &State<T, D>, page: usize) -> bool {
        let p = page as u64;
        st.forking == 0
            && !st.clock.is_sampled(p)
            && !st.clock.is_resident(p)
            && (st.fetching.contains_key(&p) || st.holds(p))
    }

    /// A missing fault by thread `tid` on a fetchable page: joins its fetch if one is in
    /// flight, else starts one, with the pages the prefetcher proposes.
    pub(crate) fn start_fetch(&self, st: &mut State<T, D>, page: usize, write: bool, tid: u32) {
        self.counters.faults.fetch_add(1, Ordering::Relaxed);
        self.fetch_fault(st, page, write, tid);
    }

    /// [`Shared::start_fetch`] of a fault already counted.
    pub(crate) fn fetch_fault(&self, st: &mut State<T, D>, page: usize, write: bool, tid: u32) {
        let p = page as u64;
        if let Some(f) = st.fetching.get_mut(&p) {
            // Another thread's fault on the same page, or a page fetched ahead and faulted on
            // before it arrived: its install wakes this thread too.
            let wrote = f.fault.is_some_and(|(w, _)| w);
            f.fault = Some((wrote || write, tid));
            self.counters
                .already_present
                .fetch_add(1, Ordering::Relaxed);
            return;
        }
        if !st.fetching.is_empty() {
            self.counters
                .batched_fetches
                .fetch_add(1, Ordering::Relaxed);
        }
        if let Some(mode) = st.prefetched.remove(&p) {
            // Fetched ahead into the pager's cache: its ticket finishes without a round trip.
            self.counters.prefetch_hits.fetch_add(1, Ordering::Relaxed);
            st.prefetcher.hit(mode);
        }
        let (ahead, mode) = self.proposals(st, page);
        let fetch = Fetch {
            fault: Some((write, tid)),
            ahead: None,
            released: false,
        };
        if let Err(e) = self.start_one(st, p, fetch) {
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
            return self.unreadable(page, tid, &e);
        }
        for a in ahead {
            if !st.pager.read_starts_now() {
                // A guess never waits for a slot ahead of a fault's read.
                break;
            }
            let fetch = Fetch {
                fault: None,
                ahead: Some(mode),
                released: false,
            };
            if let Err(e) = self.start_one(st, a, fetch) {
                tracing::debug!("prefetching page {a}: {e}");
            }
        }
    }

    /// After a zero fill: fetches ahead what the prefetcher proposes (a trend that runs on
    /// into stored pages).
    pub(crate) fn prefetch(&self, st: &mut State<T, D>, page: usize) {
        let (wanted, mode) = self.proposals(st, page);
        for p in wanted {
            if !st.pager.read_starts_now() {
                break;
            }
            let fetch = Fetch {
                fault: None,
                ahead: Some(mode),
                released: false,
            };
            if let Err(e) = self.start_one(st, p, fetch) {
                tracing::debug!("prefetching page {p}: {e}");
            }
        }
    }

    fn start_one(&self, st: &mut State<T, D>, page: u64, fetch: Fetch) -> Result<(), PagerError> {
        if !st.fetches_out() {
            st.fetch_progress = std::time::Instant::now();
        }
        st.pager.start_read(page, page)?;
        st.fetching.insert(page, fetch);
        Ok(())
    }

    /// Installs every fetch whose reply is in (waking its threads), hands the failed ones'
    /// threads SIGBUS, then makes room. Never waits for the network (but see `fetch.rs`).
    pub(crate) fn finish_fetches(&self, st: &mut State<T, D>) {
        // (Tickets, not `fetching`: one given up on by `finish_all` still holds a slot.)
        if st.pager.tickets() == 0 {
            return;
        }
        let State {
            pager,
            fetch_buf,
            fetch_done,
            ..
        } = &mut *st;
        fetch_buf.clear();
        let taken = pager.take_finished(|tag, page, data| {
            let data = data.map(|d| {
                fetch_buf.extend_from_slice(d);
                fetch_buf.len() - PAGE_SIZE
            });
            fetch_done.push((tag, page, data));
        });
        if let Err(e) = taken {
            tracing::warn!("after a fetch: {e}");
        }
        // What keeping the pages evicted goes out now: left queued, it waited for the next
        // reply or the loop's timeout (a forking Python's wall time 1.35x, 2026-11-29).
        st.pager.send_queued();
        if st.fetch_done.is_empty() {
            return;
        }
        st.fetch_progress = std::time::Instant::now();
        let mut done = std::mem::take(&mut st.fetch_done);
        let buf = std::mem::take(&mut st.fetch_buf);
        // The pages threads wait for first (the region's, then its children's); then the ones
        // fetched ahead, in address order, which is the order they queue for eviction in:
        // consecutive victims are write-protected together (`evict.rs`).
        done.sort_unstable_by_key(|&(tag, page, _)| {
            let child = fork::is_child_tag(tag) || fork::settle_tag(tag).is_some();
            let ahead = !child && st.fetching.get(&page).is_none_or(|f| f.fault.is_none());
            (ahead, child, page)
        });
        for (tag, page, data) in done.iter() {
            if let Some(p) = fork::settle_tag(*tag) {
                let data = data.as_ref().map(|&at| &buf[at..at + PAGE_SIZE]);
                self.settled(st, p, data);
                continue;
            }
            if fork::is_child_tag(*tag) {
                let data = data.as_ref().map(|&at| &buf[at..at + PAGE_SIZE]);
                self.child_fetched(st, *tag, data);
                continue;
            }
            let Some(f) = st.fetching.remove(page) else {
                continue;
            };
            let p = *page as usize;
            if f.released {
                // Given back while on its way: the page reads as zeros now, served afresh.
                if let Some((write, tid)) = f.fault {
                    self.missing(st, p, write, tid);
                }
                continue;
            }
            match (data, f.fault) {
                (Ok(at), Some((write, _))) => {
                    self.install_fetched(st, p, write, &buf[*at..*at + PAGE_SIZE]);
                }
                (Ok(at), None) => {
                    let mode = f.ahead.expect("a fetch is a fault's or ahead");
                    self.install_ahead(st, &[*page], mode, &buf[*at..*at + PAGE_SIZE]);
                }
                (Err(e), Some((_, tid))) => {
                    self.counters.errors.fetch_add(1, Ordering::Relaxed);
                    self.unreadable(p, tid, e);
                }
                // Only a guess failed: the page's own fault will report a real error.
                (Err(e), None) => tracing::debug!("prefetching page {page}: {e}"),
            }
        }
        st.fetch_done = done;
        st.fetch_done.clear();
        st.fetch_buf = buf;
        let keep = st.budget;
        self.make_room(st, keep);
    }

    /// Reads the replies that have arrived and installs what they finish; when nothing has
    /// come for [`STALLED`], fails the servers past the reply timeout (their reads go to
    /// another copy, and are installed when that answers). Never waits. `replies`: the
    /// connections to read (see [`Replies`]); what another holder of the lock read meanwhile is
    /// installed either way.
    pub(crate) fn progress_fetches(&self, st: &mut State<T, D>, replies: Replies<'_>) {
        if st.pager.tickets() == 0 {
            return;
        }
        let polled = match replies {
            Replies::All => st.pager.poll(),
            Replies::From([]) => Ok(0),
            Replies::From(servers) => st.pager.poll_from(servers.iter().copied()),
        };
        if let Err(e) = polled {
            tracing::debug!("while fetching: {e}");
        }
        self.finish_fetches(st);
        if st.fetches_out() && st.fetch_progress.elapsed() > STALLED {
            if !st.stalled {
                st.stalled = true;
                self.counters
                    .fetches_stalled
                    .fetch_add(1, Ordering::Relaxed);
            }
            if st.pager.expire(netram_pager::real_time_us()) > 0 {
                self.finish_fetches(st);
            }
        } else {
            st.stalled = false;
        }
    }

    /// Waits for every fetch in flight and installs it: before a fork, and for a fetch that
    /// stalled.
    pub(crate) fn finish_all(&self, st: &mut State<T, D>) {
        // Each round finishes a read or declares a server dead (its reads go elsewhere):
        // bounded; a few rounds cover reads sent again.
        for _ in 0..64 {
            if !st.fetches_out() {
                return;
            }
            if let Err(e) = st.pager.wait_finished() {
                tracing::debug!("while finishing fetches: {e}");
            }
            self.finish_fetches(st);
        }
        if !st.fetching.is_empty() {
            tracing::error!(
                pages = st.fetching.len(),
                "fetches that never finished: their threads are woken to fault again"
            );
            for (page, f) in std::mem::take(&mut st.fetching) {
                if f.fault.is_some() {
                    let _ = self.uffd.wake(self.base.page(page as usize), PAGE_SIZE);
                }
            }
        }
        self.abandon_child_fetches(st);
    }
}
