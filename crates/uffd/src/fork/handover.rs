//! A parent leaving (exit, `_exit`, `daemon`, the region dropped) gives each child every page
//! it lacks first, and lets it go: the child's memory must not depend on a region that is
//! going away.

use super::*;

impl<T: Transport, D: Disk> Shared<T, D> {
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
            if !st.children[i].gone && self.memory_gone(&st.children[i]) {
                // Ended already, unnoticed (a parent that waited for its child, then left):
                // nothing to read for it.
                st.children[i].gone = true;
            }
            self.await_drops(st, i);
            let child = &st.children[i];
            let needed: Vec<usize> = (0..self.pages)
                .filter(|&page| match child.state(page) {
                    page::PARENT | page::TO_PARENT => st.child_holds(page as u64),
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
                        (page, source, own, st.child_holds(source))
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
            if let Some(agent) = c.budget.as_ref().map(|b| &b.agent).or(c.watch.as_ref()) {
                agent::let_go(agent);
            }
        }
        st.settle_buf = buf;
        st.children.clear();
        st.child_fetches.clear();
        st.child_fetching.clear();
        self.child_count.store(0, Ordering::Release);
    }

    /// Waits (up to [`DROPS_WAIT`]) until child `i`'s agent has ended every drop it was asked
    /// for. A page being dropped (`TO_PARENT`, `TO_PRIVATE`) may still be resident in the
    /// child: installing it there finds it (EEXIST), and the agent's drop, read after, would
    /// leave the child without it once its region is plain memory — it read zeros there
    /// (found with a parent that leaves by `_exit` right after `fork`, its child's agent slow
    /// under load). Once the drops have ended, such pages are `PARENT` or `PRIVATE` and the
    /// hand-over installs them.
    fn await_drops(&self, st: &mut State<T, D>, i: usize) {
        let deadline = std::time::Instant::now() + DROPS_WAIT;
        loop {
            self.agent_messages(st, i);
            let child = &st.children[i];
            let Some(b) = &child.budget else {
                return;
            };
            if b.requests.is_empty() || b.broken || child.gone {
                return;
            }
            if std::time::Instant::now() >= deadline || self.agent_vanished(child) {
                tracing::warn!(
                    "a forked child's agent did not end its drops in time: pages it drops \
                     after the hand-over read as zeros in the child"
                );
                return;
            }
            sys::readable_within(&b.agent, std::time::Duration::from_millis(50));
        }
    }
}

/// How long a hand-over waits for a child's agent to end the drops it was asked for.
const DROPS_WAIT: std::time::Duration = std::time::Duration::from_secs(5);
