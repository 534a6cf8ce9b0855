//! A forked child held to its budget through its agent (`agent.rs`): its oldest pages dropped,
//! those the pager has no copy of copied out first, their copies stored under the child's own
//! page numbers (Nswap's and GMS's bound on what a node keeps locally, per process).

use super::*;

impl<T: Transport, D: Disk> Shared<T, D> {
    /// Asks child `i`'s agent to drop its oldest pages while it holds more than its budget:
    /// pages equal to a copy in the pager are only dropped; the others are write-protected
    /// first and copied by the agent (see `agent.rs`).
    pub(super) fn enforce_budget(&self, st: &mut State<T, D>, i: usize) {
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
    pub(super) fn agent_vanished(&self, child: &ForkChild) -> bool {
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
    pub(super) fn resume_waiting(&self, st: &mut State<T, D>, i: usize) {
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
    pub(super) fn agent_messages(&self, st: &mut State<T, D>, i: usize) {
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
        // Never waited for: the handler holds the region while it stores them, and every fault
        // (the parent's, the children's) would wait behind a round trip here; the agent has
        // dropped the page, so the data cannot be left for later either. A page of zeros whose
        // last write-back is still out is written as zeros rather than deleted after it.
        let stored = if data.iter().all(|&b| b == 0) {
            pager.try_discard(private).and_then(|done| match done {
                true => Ok(()),
                false => pager.write_over_budget(private, data),
            })
        } else {
            self.counters
                .child_private_pages
                .fetch_add(1, Ordering::Relaxed);
            pager.write_over_budget(private, data)
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
    pub(super) fn agent_lost(&self, st: &mut State<T, D>, i: usize) {
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
}
