//! A segment's library site (MIRAGE+ §2.2): every request for one of its pages comes here, is
//! queued, and is served one at a time per page. The library keeps the page's directory —
//! which site is the clock site (the newest copy, §2.2) and which sites hold copies — and
//! serves the next request only once the current one is done: every invalidation
//! acknowledged and the page installed at its requester (`Done`). Nothing else changes a
//! copy, so the directory is exact, and that is what makes one writer or many readers hold.
//!
//! Pages move directly from the clock site to the requester (the library sends the clock
//! site an order, `Send`); an upgrade (a reader that wants to write) moves no data. Requests
//! from sites the segment's creator has not admitted, repeated ones, and messages about
//! another request (an old ticket) are dropped and counted.

use crate::msg::{Access, Msg, PageNo, SiteId, Ticket, Want};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// Where a request being served is.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Phase {
    /// Waiting for these sites to drop their copies.
    Invalidating(BTreeSet<SiteId>),
    /// The page (or the grant) is on its way; waiting for the requester's `Done`.
    Installing,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Active {
    site: SiteId,
    want: Want,
    ticket: Ticket,
    phase: Phase,
}

/// One page's directory and its queue.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Page {
    clock: SiteId,
    /// `Read`: every site in `copies` may read; `Write`: `clock` alone holds it, writable.
    mode: Access,
    copies: BTreeSet<SiteId>,
    queue: VecDeque<(SiteId, Want)>,
    active: Option<Active>,
}

/// What the library dropped, by reason.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Counters {
    pub requests: u64,
    pub requests_not_member: u64,
    pub requests_repeated: u64,
    /// Requests the directory says need nothing (the site has that access already): a site
    /// and its library disagree, which an honest site never causes.
    pub requests_confused: u64,
    pub invalidations: u64,
    pub upgrades: u64,
    pub transfers: u64,
    /// Acknowledgements and `Done`s that match no request being served.
    pub stale: u64,
}

/// A segment's library.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Library {
    /// The creator: initially the clock site of every page (a zero page it holds).
    creator: SiteId,
    /// The sites admitted; `None`: every site the transport lets speak (the cluster's
    /// authenticated members).
    members: Option<BTreeSet<SiteId>>,
    pages: BTreeMap<PageNo, Page>,
    next_ticket: Ticket,
    pub counters: Counters,
}

/// Messages to send: (to whom, what).
pub type Out<D> = Vec<(SiteId, Msg<D>)>;

/// A page's entry, made on first use: the creator holds it (a zero page, checked in).
fn page_of(pages: &mut BTreeMap<PageNo, Page>, creator: SiteId, page: PageNo) -> &mut Page {
    pages.entry(page).or_insert_with(|| Page {
        clock: creator,
        mode: Access::Read,
        copies: BTreeSet::from([creator]),
        queue: VecDeque::new(),
        active: None,
    })
}

impl Library {
    /// The library of a segment created by `creator`, which admits `members` (the creator
    /// always).
    pub fn new(creator: SiteId, members: impl IntoIterator<Item = SiteId>) -> Self {
        let mut members: BTreeSet<SiteId> = members.into_iter().collect();
        members.insert(creator);
        Self {
            creator,
            members: Some(members),
            pages: BTreeMap::new(),
            next_ticket: 1,
            counters: Counters::default(),
        }
    }

    /// The library of a segment created by `creator` that admits every site.
    pub fn open(creator: SiteId) -> Self {
        Self {
            members: None,
            ..Self::new(creator, [])
        }
    }

    pub fn admit(&mut self, site: SiteId) {
        if let Some(m) = self.members.as_mut() {
            m.insert(site);
        }
    }

    /// Whether `site` may take part.
    pub fn admits(&self, site: SiteId) -> bool {
        self.members.as_ref().is_none_or(|m| m.contains(&site))
    }

    fn page(&mut self, page: PageNo) -> &mut Page {
        page_of(&mut self.pages, self.creator, page)
    }

    /// The clock site of `page` and the sites with a copy (for checks and reports).
    pub fn holders(&self, page: PageNo) -> (SiteId, Access, Vec<SiteId>) {
        match self.pages.get(&page) {
            Some(p) => (p.clock, p.mode, p.copies.iter().copied().collect()),
            None => (self.creator, Access::Read, vec![self.creator]),
        }
    }

    /// Whether a request for `page` is being served or waits.
    pub fn busy(&self, page: PageNo) -> bool {
        self.pages
            .get(&page)
            .is_some_and(|p| p.active.is_some() || !p.queue.is_empty())
    }

    /// A message from site `from`.
    pub fn on_msg<D>(&mut self, from: SiteId, msg: Msg<D>) -> Out<D> {
        let mut out = Vec::new();
        match msg {
            Msg::Request { page, want } => self.request(from, page, want, &mut out),
            Msg::Invalidated { page, ticket } => self.invalidated(from, page, ticket, &mut out),
            Msg::Done { page, ticket } => self.done(from, page, ticket, &mut out),
            // Orders and pages are for sites: a site that sends one here is confused.
            _ => self.counters.stale += 1,
        }
        out
    }

    fn request<D>(&mut self, from: SiteId, page: PageNo, want: Want, out: &mut Out<D>) {
        if !self.admits(from) {
            self.counters.requests_not_member += 1;
            return;
        }
        let p = self.page(page);
        // One request per site and page at a time: a site waits for its answer.
        if p.queue.iter().any(|&(s, _)| s == from)
            || p.active.as_ref().is_some_and(|a| a.site == from)
        {
            self.counters.requests_repeated += 1;
            return;
        }
        p.queue.push_back((from, want));
        self.counters.requests += 1;
        self.serve(page, out);
    }

    /// Starts the page's next request, if none is being served.
    fn serve<D>(&mut self, page: PageNo, out: &mut Out<D>) {
        loop {
            let ticket = self.next_ticket;
            let p = page_of(&mut self.pages, self.creator, page);
            if p.active.is_some() {
                return;
            }
            let Some((site, want)) = p.queue.pop_front() else {
                return;
            };
            let has = p.copies.contains(&site);
            let access = if !has {
                Access::None
            } else if p.mode == Access::Write {
                Access::Write
            } else {
                Access::Read
            };
            if access >= want.access() {
                self.counters.requests_confused += 1;
                continue;
            }
            self.next_ticket += 1;
            match want {
                Want::Read => {
                    // A copy from the clock site; a writer keeps a read copy (downgrade).
                    out.push((
                        p.clock,
                        Msg::Send {
                            page,
                            to: site,
                            grant: Want::Read,
                            ticket,
                        },
                    ));
                    p.copies.insert(site);
                    p.mode = Access::Read;
                    p.active = Some(Active {
                        site,
                        want,
                        ticket,
                        phase: Phase::Installing,
                    });
                    self.counters.transfers += 1;
                }
                Want::Write => {
                    // Every other copy goes first; the clock site's too when the requester
                    // holds the newest copy itself (an upgrade), else the clock site drops its
                    // copy as it sends it.
                    let clock = p.clock;
                    let drop: BTreeSet<SiteId> = p
                        .copies
                        .iter()
                        .copied()
                        .filter(|&s| s != site && (has || s != clock))
                        .collect();
                    for &s in &drop {
                        out.push((s, Msg::Invalidate { page, ticket }));
                    }
                    self.counters.invalidations += drop.len() as u64;
                    p.active = Some(Active {
                        site,
                        want,
                        ticket,
                        phase: Phase::Invalidating(drop),
                    });
                    self.invalidations_done(page, out);
                }
            }
            return;
        }
    }

    /// Once every copy to drop is gone: the write request's grant or transfer.
    fn invalidations_done<D>(&mut self, page: PageNo, out: &mut Out<D>) {
        let p = self.page(page);
        let Some(a) = p.active.as_mut() else { return };
        if !matches!(&a.phase, Phase::Invalidating(w) if w.is_empty()) {
            return;
        }
        a.phase = Phase::Installing;
        let (site, ticket) = (a.site, a.ticket);
        if p.copies.contains(&site) {
            out.push((site, Msg::Grant { page, ticket }));
            self.counters.upgrades += 1;
        } else {
            out.push((
                p.clock,
                Msg::Send {
                    page,
                    to: site,
                    grant: Want::Write,
                    ticket,
                },
            ));
            self.counters.transfers += 1;
        }
        let p = self.page(page);
        p.clock = site;
        p.mode = Access::Write;
        p.copies = BTreeSet::from([site]);
    }

    fn invalidated<D>(&mut self, from: SiteId, page: PageNo, ticket: Ticket, out: &mut Out<D>) {
        let p = self.page(page);
        let expected = match p.active.as_mut() {
            Some(Active {
                ticket: t,
                phase: Phase::Invalidating(waiting),
                ..
            }) if *t == ticket => waiting.remove(&from),
            _ => false,
        };
        if expected {
            p.copies.remove(&from);
            self.invalidations_done(page, out);
        } else {
            self.counters.stale += 1;
        }
    }

    fn done<D>(&mut self, from: SiteId, page: PageNo, ticket: Ticket, out: &mut Out<D>) {
        let p = self.page(page);
        match &p.active {
            Some(a) if a.site == from && a.ticket == ticket && a.phase == Phase::Installing => {
                p.active = None;
                self.serve(page, out);
            }
            _ => self.counters.stale += 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type M = Msg<u8>;

    #[test]
    fn strangers_repeats_and_stale_answers_are_dropped_and_counted() {
        let mut l = Library::new(1, [2]);
        assert!(l
            .on_msg::<u8>(
                9,
                Msg::Request {
                    page: 0,
                    want: Want::Read
                }
            )
            .is_empty());
        assert_eq!(l.counters.requests_not_member, 1);
        let out: Vec<(SiteId, M)> = l.on_msg(
            2,
            Msg::Request {
                page: 0,
                want: Want::Read,
            },
        );
        assert_eq!(
            out,
            [(
                1,
                Msg::Send {
                    page: 0,
                    to: 2,
                    grant: Want::Read,
                    ticket: 1
                }
            )]
        );
        // The same site again before its answer; a Done with another ticket or from another
        // site; an acknowledgement nobody asked for.
        assert!(l
            .on_msg::<u8>(
                2,
                Msg::Request {
                    page: 0,
                    want: Want::Write
                }
            )
            .is_empty());
        assert!(l
            .on_msg::<u8>(2, Msg::Done { page: 0, ticket: 7 })
            .is_empty());
        assert!(l
            .on_msg::<u8>(1, Msg::Done { page: 0, ticket: 1 })
            .is_empty());
        assert!(l
            .on_msg::<u8>(2, Msg::Invalidated { page: 0, ticket: 1 })
            .is_empty());
        assert_eq!((l.counters.requests_repeated, l.counters.stale), (1, 3));
        assert!(l.busy(0));
        assert!(l
            .on_msg::<u8>(2, Msg::Done { page: 0, ticket: 1 })
            .is_empty());
        assert!(!l.busy(0));
        assert_eq!(l.holders(0), (1, Access::Read, vec![1, 2]));
    }

    /// An upgrade invalidates every other copy, the clock site's included, and grants without
    /// moving the page; the next request waits until the writer has its grant.
    #[test]
    fn an_upgrade_invalidates_all_others_then_grants() {
        let mut l = Library::new(1, [2, 3]);
        for s in [2, 3] {
            let out: Vec<(SiteId, M)> = l.on_msg(
                s,
                Msg::Request {
                    page: 5,
                    want: Want::Read,
                },
            );
            let Msg::Send { ticket, .. } = out[0].1 else {
                panic!("{out:?}")
            };
            l.on_msg::<u8>(s, Msg::Done { page: 5, ticket });
        }
        let out: Vec<(SiteId, M)> = l.on_msg(
            2,
            Msg::Request {
                page: 5,
                want: Want::Write,
            },
        );
        let to: Vec<SiteId> = out.iter().map(|o| o.0).collect();
        assert_eq!(to, [1, 3]);
        assert!(out.iter().all(|o| matches!(o.1, Msg::Invalidate { .. })));
        // Another request meanwhile is queued.
        assert!(l
            .on_msg::<u8>(
                3,
                Msg::Request {
                    page: 5,
                    want: Want::Read
                }
            )
            .is_empty());
        let ticket = 3;
        assert!(l
            .on_msg::<u8>(1, Msg::Invalidated { page: 5, ticket })
            .is_empty());
        let out: Vec<(SiteId, M)> = l.on_msg(3, Msg::Invalidated { page: 5, ticket });
        assert_eq!(out, [(2, Msg::Grant { page: 5, ticket })]);
        assert_eq!(l.holders(5), (2, Access::Write, vec![2]));
        // The queued read: the writer is downgraded to send it.
        let out: Vec<(SiteId, M)> = l.on_msg(2, Msg::Done { page: 5, ticket });
        assert_eq!(
            out,
            [(
                2,
                Msg::Send {
                    page: 5,
                    to: 3,
                    grant: Want::Read,
                    ticket: 4
                }
            )]
        );
    }
}
