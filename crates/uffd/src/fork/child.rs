//! Serving a forked child's faults: its missing pages installed from the parent's copy or its
//! own in the pager, read by ticket with the pages its prefetcher proposes, its userfaultfd's
//! events read and its end noticed (Anemone §2.2: each fault its own request).

use super::*;

impl<T: Transport, D: Disk> Shared<T, D> {
    /// Installs `page` in child `i` as it reads it (for its thread `tid` if it faulted): the
    /// parent's copy or the child's own, read from the pager now (waiting for it: see
    /// [`Shared::fetch_for_child`] for the way that does not); write-protected for a child
    /// with a budget while that pays, so that its first write is seen.
    pub(crate) fn install_in_child(&self, st: &mut State<T, D>, i: usize, page: usize, tid: u32) {
        let (source, own) = self.child_source(&st.children[i], page);
        let held = st.child_holds(source);
        let State {
            pager,
            children,
            child_buf,
            ..
        } = st;
        let data = if held {
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
    pub(super) fn place_in_child(
        &self,
        child: &mut ForkChild,
        page: usize,
        own: bool,
        data: Option<&[u8]>,
    ) {
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
        if !st.child_holds(source) {
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
            if !st.pager.read_starts_now() {
                // A guess never waits for a slot ahead of a fault's read.
                break;
            }
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
            if !st.child_holds(source) {
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
            self.expire_fork(&mut st);
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
            if probe && !st.children[i].gone && self.memory_gone(&st.children[i]) {
                st.children[i].gone = true;
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
            self.progress_fetches(&mut st, Replies::All);
        }
    }

    /// Whether `child`'s memory is gone (it exited or exec'd). No event says so; an ioctl on
    /// it does (ESRCH): write-protecting its first page as it already is changes nothing it
    /// can see.
    pub(super) fn memory_gone(&self, child: &ForkChild) -> bool {
        let protected = matches!(
            child.state(0),
            page::CLEAN | page::PRIVATE_CLEAN | page::TO_PARENT | page::TO_PRIVATE
        );
        matches!(
            child
                .uffd
                .set_write_protect(self.base.page(0), protected, false),
            Err(rustix::io::Errno::SRCH)
        )
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
        // Not waited for (the handler holds the region, every fault would wait): a page whose
        // last write-back is still out is deleted once it is in (`delete_leftovers`).
        for p in (0..self.pages).map(|p| self.private(slot, p)) {
            if !st.holds(p) {
                continue;
            }
            match st.pager.try_discard(p) {
                Ok(true) => {}
                Ok(false) => st.undeleted.push(p),
                Err(e) => tracing::warn!("deleting a forked child's page: {e}"),
            }
        }
        st.pager.send_queued();
    }

    /// Deletes the pages of ended children whose write-back has come in since (see
    /// `forget_child`), and the pages given back while theirs was out (`defer_delete`); never
    /// waits.
    pub(crate) fn delete_leftovers(&self, st: &mut State<T, D>) {
        if st.undeleted.is_empty() && st.released.is_empty() {
            return;
        }
        let State {
            pager,
            undeleted,
            released,
            release_settling,
            ..
        } = st;
        // The acknowledgements that arrived (nothing else may have read them).
        if let Err(e) = pager.poll() {
            tracing::debug!("deleting a forked child's pages: {e}");
        }
        undeleted.retain(|&p| match pager.try_discard(p) {
            Ok(done) => !done,
            Err(e) => {
                tracing::warn!("deleting a forked child's page: {e}");
                false
            }
        });
        // And the pages given back while their write-back was out, or their copy was being
        // read for children.
        released.retain(|&p| match release_settling.contains(&p) {
            // Still read for the children (`settle_released`).
            true => true,
            false => match pager.try_discard(p) {
                Ok(done) => !done,
                Err(e) => {
                    tracing::warn!("deleting page {p} given back: {e}");
                    false
                }
            },
        });
        pager.send_queued();
    }

    /// Deletes what an ended child left in child slot `slot`, waiting for the write-backs
    /// still out (a fork that comes within a round trip of the last child's end): a new child
    /// in that slot must not have its pages deleted by them later.
    pub(super) fn clear_slot(&self, st: &mut State<T, D>, slot: u64) {
        let first = self.private(slot, 0);
        let range = first..first + self.pages as u64;
        let left: Vec<u64> = st
            .undeleted
            .iter()
            .copied()
            .filter(|p| range.contains(p))
            .collect();
        if left.is_empty() {
            return;
        }
        st.undeleted.retain(|p| !range.contains(p));
        if let Err(e) = st.pager.discard_many(&left) {
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
}
