//! Before the parent's side changes a page in the pager, the contents every child still reads
//! from there are kept for it: installed in a child without a budget, stored under the child's
//! own page number for one with (Linux's fork semantics kept across paging, Anemone §2.2).

use super::*;

impl<T: Transport, D: Disk> Shared<T, D> {
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
        }) && st.holds(page as u64)
    }

    /// Before dirty victims leave while children live: the pager copies some child still
    /// reads are read by ticket (a few at a time, [`MAX_SETTLING`]), and those victims are
    /// taken out of the batch and stay resident (dirty, and to be written back later) until
    /// their read is in and their old contents are kept for the children (`settled`); no
    /// victim waits for that read. With [`MAX_SETTLING`] reads out already, such a victim
    /// stays resident without one, chosen again by a later batch: the region goes over its
    /// budget meanwhile, and past its margin the handler holds new faults until room returns
    /// (`holds_faults`). Only what cannot be read by ticket at all (a victim aside, a read
    /// that fails to start) is read in one pipelined, waiting read (`settle_many`). `chosen`
    /// keeps the victims to evict now.
    pub(crate) fn settle_ahead(&self, st: &mut State<T, D>, chosen: &mut Vec<(usize, bool)>) {
        let mut now = Vec::new();
        let mut later = Vec::new();
        for &(page, sampled) in chosen.iter() {
            if st.release_settling.contains(&(page as u64)) {
                // Given back and touched again while its old copy is read for the children:
                // stored now, it would replace that copy (see `settle_released`).
                later.push(page);
                continue;
            }
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
            // Victims' reads only: those of pages given back (`settle_released`) hold no
            // victim resident.
            if st.settling.len().saturating_sub(st.release_settling.len()) < MAX_SETTLING {
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
                now.push(page);
            } else {
                // Enough reads out: this victim waits resident for a later batch, rather
                // than the handler for its read.
                later.push(page);
            }
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
        let given_back = st.release_settling.contains(&(page as u64));
        match data {
            Ok(bytes) => self.settle_from(st, page, Some(bytes)),
            // Given back: read once more, waiting (and what cannot be is lost to them).
            Err(e) if given_back => {
                tracing::debug!("reading page {page} given back, for children: {e}");
                self.settle_from(st, page, None);
            }
            // Its write-back settles it the waiting way (and says what is lost).
            Err(e) => tracing::debug!("reading page {page} for children: {e}"),
        }
        // No child reads it from there any more: its delete goes ahead (`delete_leftovers`).
        st.release_settling.remove(&(page as u64));
    }

    /// Of `pages`, being given back (`release`), those some child still reads from the
    /// pager: their copies are read for the children by ticket, as `settle_ahead` reads
    /// victims', rather than waited for; meanwhile the children read them there, and their
    /// deletes wait (`release_settling`). Returns the pages to read now, the waiting way:
    /// those whose read could not start, or all of them while a fork is pending (its child
    /// must not be given the old contents of a page given back before it; `prepare_fork` and
    /// a fork's event finish the reads in flight before a child is added).
    pub(crate) fn settle_released(&self, st: &mut State<T, D>, pages: &[usize]) -> Vec<usize> {
        if st.forking > 0 {
            return pages.to_vec();
        }
        let mut now = Vec::new();
        for &page in pages {
            if !self.read_by_children(st, page) {
                continue;
            }
            if !st.settling.contains(&page) {
                if !st.fetches_out() {
                    st.fetch_progress = std::time::Instant::now();
                }
                if let Err(e) = st.pager.start_read(page as u64, SETTLE_TAG | page as u64) {
                    tracing::debug!("reading page {page} given back, for children: {e}");
                    now.push(page);
                    continue;
                }
                st.settling.insert(page);
            }
            // (A victim's read already out serves as well: it reads the same copy.)
            st.release_settling.insert(page as u64);
            self.counters
                .releases_settling
                .fetch_add(1, Ordering::Relaxed);
        }
        now
    }

    /// [`Shared::settle`], with the page's current contents in `known` if they were read
    /// already.
    pub(crate) fn settle_from(&self, st: &mut State<T, D>, page: usize, known: Option<&[u8]>) {
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
        let held = st.child_holds(page as u64);
        let State {
            pager, child_buf, ..
        } = st;
        if !held {
            // Zeros: the child's own page number was never written (or was deleted).
            return true;
        }
        let copied = match known {
            Some(data) => pager.write_over_budget(private, data),
            None => pager
                .read(page as u64, child_buf)
                .and_then(|()| pager.write_over_budget(private, child_buf)),
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
    pub(super) fn child_source(&self, child: &ForkChild, page: usize) -> (u64, bool) {
        let own = matches!(child.state(page), page::PRIVATE | page::TO_PRIVATE);
        let source = match (&child.budget, own) {
            (Some(b), true) => self.private(b.slot, page),
            _ => page as u64,
        };
        (source, own)
    }
}
