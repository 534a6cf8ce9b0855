//! One machine's part in a segment (MIRAGE+ §2.1–2.2): the access it has to each page, its
//! faults turned into requests to the library, and the library's orders carried out.
//!
//! **The time window Δ** (§2.1): a page installed here is kept at least Δ before an order
//! takes it away (or downgrades it), so that the processes that faulted for it use it before
//! another site takes it. With Δ = 0 MIRAGE+ saw pages taken before they were touched, over
//! and over (§5.4), and added a check that a page is not given up before it has been used: so
//! does this site — a page installed for a fault is held until the runtime says the access
//! happened ([`Site::accessed`]) as well as for Δ. An order that arrives within the window
//! waits (in order) and is carried out by [`Site::tick`] once the window has passed.
//!
//! A page this site never touched is held by nobody here (`Access::None`), except at the
//! segment's creator, which holds every page at first (a zero page: "checked in" at the
//! library, §4.3).

use crate::library::{era_of, Held, Report};
use crate::msg::{Access, Msg, PageNo, SiteId, Ticket, Want};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// Acknowledgements kept per page that arrived before the page or grant they belong to
/// (they come from other sites than it does, so they may overtake it). Only sites the
/// transport authenticated send them, one each per request; more are refused.
const MAX_EARLY_ACKS: usize = 256;

/// A page or grant that arrived, waiting for acknowledgements that other copies are gone.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Waiting<D> {
    ticket: Ticket,
    grant: Want,
    /// The sites still to acknowledge.
    acks: BTreeSet<SiteId>,
    /// The page's contents (`None`: an upgrade's grant, the copy here is the page).
    data: Option<D>,
}

/// What a fault needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault<D> {
    /// The access is here: retry it.
    Ready,
    /// A request for the page is on its way: wait for it.
    Wait,
    /// Send this request to the library, then wait.
    Ask(SiteId, Msg<D>),
    /// The page was lost with a site that crashed: the access fails.
    Lost,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Page<D> {
    access: Access,
    data: Option<D>,
    /// Not to be taken away before (ms), nor before it has been used.
    hold_until: u64,
    used: bool,
    /// The request on its way, if any.
    asked: Option<Want>,
    /// Orders waiting for the window to pass, in arrival order.
    deferred: VecDeque<Msg<D>>,
    /// The write copy this site sent away, kept until the library says the requester
    /// installed it (`Forget`) or crashed first (`Restore`): (the transfer's ticket, data).
    ghost: Option<(Ticket, D)>,
    /// The newest ticket installed here: a page or grant under it or an older one is a
    /// duplicate (a crashed sender's, arriving late) and is refused.
    installed: Ticket,
    /// A ticket this site told the library it did not get (`Missing`): refused if it comes.
    refused: Option<Ticket>,
    /// Lost with a crashed site: every access fails.
    lost: bool,
    /// The answer to this site's write request, waiting for acknowledgements.
    waiting: Option<Waiting<D>>,
    /// Acknowledgements that came first: (ticket, site).
    early: BTreeSet<(Ticket, SiteId)>,
}

/// What the site dropped, by reason.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Counters {
    pub requests: u64,
    pub installs: u64,
    pub upgrades: u64,
    pub sent: u64,
    pub invalidated: u64,
    /// Orders carried out after waiting for the window.
    pub deferred: u64,
    /// Write copies taken back after their requester crashed.
    pub restored: u64,
    /// Requests answered "lost".
    pub lost: u64,
    /// Messages that did not fit this site's state (a page it did not ask for, an order for a
    /// copy it does not hold, anything from a site that is not the library where only the
    /// library may speak): dropped.
    pub refused: u64,
}

/// One site of one segment. `D` is a page's contents.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Site<D> {
    me: SiteId,
    library: SiteId,
    /// The oldest era whose tickets this site takes: a page or order of a crashed library's
    /// time (older) is refused ([`Site::library_down`]).
    era: u64,
    /// Its library crashed and the next is not known yet: faults wait, nothing is asked.
    orphaned: bool,
    creator: bool,
    delta_ms: u64,
    pages: BTreeMap<PageNo, Page<D>>,
    /// The pages with orders waiting (`deferred` not empty): what [`Site::tick`] and
    /// [`Site::next_deadline`] look at, called on every turn of the runtime's loop (scanning
    /// every page held cost ~50 µs a message with a few thousand).
    waiting_orders: BTreeSet<PageNo>,
    /// Pages whose write copy was taken back (`Restore`) since [`Site::take_restored`].
    restored: Vec<PageNo>,
    pub counters: Counters,
}

/// Messages to send: (to whom, what).
pub type Out<D> = Vec<(SiteId, Msg<D>)>;

impl<D: Clone + Default> Site<D> {
    /// Site `me` of a segment whose library is `library`; `creator`: this site created it
    /// (and holds every page at first); `delta_ms`: the segment's time window. The clock's
    /// unit is the caller's (the runtime feeds microseconds, the model steps): "ms" names
    /// what MIRAGE+ used.
    pub fn new(me: SiteId, library: SiteId, creator: bool, delta_ms: u64) -> Self {
        Self {
            me,
            library,
            era: 0,
            orphaned: false,
            creator,
            delta_ms,
            pages: BTreeMap::new(),
            waiting_orders: BTreeSet::new(),
            restored: Vec::new(),
            counters: Counters::default(),
        }
    }

    pub fn id(&self) -> SiteId {
        self.me
    }

    fn page(&mut self, page: PageNo) -> &mut Page<D> {
        let creator = self.creator;
        self.pages.entry(page).or_insert_with(|| Page {
            access: if creator { Access::Read } else { Access::None },
            data: creator.then(D::default),
            hold_until: 0,
            used: true,
            asked: None,
            deferred: VecDeque::new(),
            ghost: None,
            installed: 0,
            refused: None,
            lost: false,
            waiting: None,
            early: BTreeSet::new(),
        })
    }

    /// The pages whose write copy was taken back since the last call: the runtime puts their
    /// kept contents back and makes them writable. (Asked explicitly: a copy forgotten while
    /// this site holds the page's write copy again for another reason looks the same from
    /// outside, and putting the old contents back then would undo later writes.)
    pub fn take_restored(&mut self) -> Vec<PageNo> {
        std::mem::take(&mut self.restored)
    }

    /// Whether this site keeps the write copy it sent away (until `Forget` or `Restore`).
    pub fn has_ghost(&self, page: PageNo) -> bool {
        self.pages.get(&page).is_some_and(|p| p.ghost.is_some())
    }

    /// Whether the page was lost with a crashed site.
    pub fn is_lost(&self, page: PageNo) -> bool {
        self.pages.get(&page).is_some_and(|p| p.lost)
    }

    /// The access this site has to `page`.
    pub fn access(&self, page: PageNo) -> Access {
        match self.pages.get(&page) {
            Some(p) => p.access,
            None if self.creator => Access::Read,
            None => Access::None,
        }
    }

    /// The pages this site may write (a mapping attached later must leave them writable).
    pub fn writable(&self) -> impl Iterator<Item = PageNo> + '_ {
        self.pages
            .iter()
            .filter(|(_, p)| p.access == Access::Write)
            .map(|(&n, _)| n)
    }

    /// The page's contents here, if this site holds a copy.
    pub fn data(&mut self, page: PageNo) -> Option<&mut D> {
        self.page(page).data.as_mut()
    }

    /// Whether a request for `page` is on its way.
    pub fn asked(&self, page: PageNo) -> Option<Want> {
        self.pages.get(&page).and_then(|p| p.asked)
    }

    /// Whether `page`'s contents arrived and wait for acknowledgements before they are
    /// installed (the runtime keeps the bytes meanwhile).
    pub fn holds_arrived(&self, page: PageNo) -> bool {
        self.pages
            .get(&page)
            .is_some_and(|p| p.waiting.as_ref().is_some_and(|w| w.data.is_some()))
    }

    /// The library crashed: this site stops taking its orders and the pages sent on them
    /// (everything of its era, from now on), drops its request on their way (the faults
    /// behind them wait for the next library, [`Site::new_library`]) and the orders waiting
    /// for a window, and reports what it holds for the next library to be rebuilt from
    /// ([`crate::Library::rebuild`]). The creator's implicit pages are not reported: the
    /// creator is the first library, so it is the one that crashed.
    pub fn library_down(&mut self) -> Report {
        let report = Report {
            era: self.era,
            pages: self
                .pages
                .iter()
                .filter(|(_, p)| {
                    p.access != Access::None || p.ghost.is_some() || p.lost || p.installed > 0
                })
                .map(|(&page, p)| Held {
                    page,
                    access: p.access,
                    ghost: p.ghost.as_ref().map(|(t, _)| *t),
                    installed: p.installed,
                    lost: p.lost,
                })
                .collect(),
        };
        self.era += 1;
        self.orphaned = true;
        self.waiting_orders.clear();
        self.creator = false;
        for p in self.pages.values_mut() {
            p.asked = None;
            p.deferred.clear();
            p.waiting = None;
            p.early.clear();
        }
        report
    }

    /// The segment's library is `library` now, giving tickets of era `era`
    /// ([`crate::Library::era`]): faults ask it.
    pub fn new_library(&mut self, library: SiteId, era: u64) {
        self.library = library;
        self.era = self.era.max(era);
        self.orphaned = false;
    }

    /// The segment's library.
    pub fn library(&self) -> SiteId {
        self.library
    }

    /// Whether the library crashed and the next is not known yet.
    pub fn is_orphaned(&self) -> bool {
        self.orphaned
    }

    /// A process here faulted on `page`, wanting `want`.
    pub fn fault(&mut self, page: PageNo, want: Want) -> Fault<D> {
        let library = self.library;
        let orphaned = self.orphaned;
        let p = self.page(page);
        if p.lost {
            return Fault::Lost;
        }
        if p.access >= want.access() {
            return Fault::Ready;
        }
        if orphaned {
            // Asked again once the next library is known.
            return Fault::Wait;
        }
        if p.asked.is_some() {
            // One request per page at a time; a write fault behind a read request asks
            // again once the read is answered (its retry faults again).
            return Fault::Wait;
        }
        p.asked = Some(want);
        self.counters.requests += 1;
        Fault::Ask(library, Msg::Request { page, want })
    }

    /// The access the faulting process wanted has happened (it ran after its wake-up): the
    /// page may be taken away once its window has passed.
    pub fn accessed(&mut self, page: PageNo) {
        self.page(page).used = true;
    }

    /// A message from `from` at time `now_ms`: what to send, and the page installed (its
    /// faulting processes to wake), if any.
    pub fn on_msg(&mut self, from: SiteId, msg: Msg<D>, now_ms: u64) -> (Out<D>, Option<PageNo>) {
        let mut out = Vec::new();
        let page = msg.page();
        let library = self.library;
        // From the crashed library, once this site has reported (what it reported stands):
        // refused.
        if self.orphaned && from == library {
            self.counters.refused += 1;
            return (out, None);
        }
        // Of a crashed library's time: refused. (Forget and Restore name a kept copy by its
        // transfer's ticket, which is older than the library that rebuilt from it.)
        if let Some(t) = msg.ticket() {
            if era_of(t) < self.era && !matches!(msg, Msg::Forget { .. } | Msg::Restore { .. }) {
                self.counters.refused += 1;
                return (out, None);
            }
        }
        match msg {
            Msg::Send { .. } | Msg::Invalidate { .. } | Msg::Restore { .. } if from == library => {
                let p = self.page(page);
                if !p.deferred.is_empty() || !Self::releasable(p, now_ms) {
                    p.deferred.push_back(msg);
                    self.waiting_orders.insert(page);
                } else {
                    self.carry_out(msg, &mut out);
                }
            }
            Msg::Page {
                grant,
                ticket,
                data,
                wait,
                ..
            } => {
                let p = self.page(page);
                // Only the page asked for, with no more access than asked, under a ticket
                // newer than any installed and not one this site said it did not get: a page
                // nobody asked for (a forged one, a confused sender's, a crashed sender's
                // arriving late) changes nothing.
                if p.asked.is_none_or(|w| w < grant)
                    || ticket <= p.installed
                    || p.refused == Some(ticket)
                    || p.waiting.is_some()
                {
                    self.counters.refused += 1;
                    return (out, None);
                }
                let w = Waiting {
                    ticket,
                    grant,
                    acks: wait.into_iter().collect(),
                    data: Some(data),
                };
                return self.arrived(page, w, now_ms);
            }
            Msg::Grant { ticket, wait, .. } if from == library => {
                let p = self.page(page);
                if p.asked.is_some_and(|w| p.access >= w.access()) {
                    // The library found this site has what it asked for already (its write
                    // copy given back meanwhile): nothing moves, no Done.
                    p.asked = None;
                    p.early.clear();
                    return (out, Some(page));
                }
                if p.access != Access::Read
                    || p.asked != Some(Want::Write)
                    || ticket <= p.installed
                    || p.waiting.is_some()
                {
                    self.counters.refused += 1;
                    return (out, None);
                }
                let w = Waiting {
                    ticket,
                    grant: Want::Write,
                    acks: wait.into_iter().collect(),
                    data: None,
                };
                return self.arrived(page, w, now_ms);
            }
            Msg::Ack { ticket, .. } => return self.acked(page, ticket, from, now_ms),
            Msg::Excuse { ticket, site, .. } if from == library => {
                return self.acked(page, ticket, site, now_ms)
            }
            Msg::Forget { ticket, .. } if from == library => {
                let p = self.page(page);
                if p.ghost.as_ref().is_some_and(|(t, _)| *t == ticket) {
                    p.ghost = None;
                }
            }
            Msg::Probe { ticket, .. } if from == library => {
                let p = self.page(page);
                if p.installed == ticket {
                    // It came: the Done already sent may have been lost with nothing; again.
                    out.push((library, Msg::Done { page, ticket }));
                } else if p.waiting.as_ref().is_some_and(|w| w.ticket == ticket) {
                    // It came and waits for acknowledgements: its Done follows them.
                } else {
                    p.refused = Some(ticket);
                    out.push((library, Msg::Missing { page, ticket }));
                }
            }
            Msg::Lost { .. } if from == library => {
                let p = self.page(page);
                if p.asked.is_none() {
                    self.counters.refused += 1;
                    return (out, None);
                }
                p.asked = None;
                p.access = Access::None;
                p.data = None;
                p.lost = true;
                p.waiting = None;
                p.early.clear();
                self.counters.lost += 1;
                // Its faulting processes are woken to find it lost.
                return (out, Some(page));
            }
            _ => self.counters.refused += 1,
        }
        (out, None)
    }

    /// The answer to this site's request arrived: installed now if no acknowledgement is
    /// missing (some may have come first), else when the last comes.
    fn arrived(
        &mut self,
        page: PageNo,
        mut w: Waiting<D>,
        now_ms: u64,
    ) -> (Out<D>, Option<PageNo>) {
        let p = self.page(page);
        let early = std::mem::take(&mut p.early);
        for (t, s) in early {
            if t == w.ticket {
                w.acks.remove(&s);
            }
        }
        p.waiting = Some(w);
        self.install_if_acked(page, now_ms)
    }

    /// Site `site` dropped its copy for ticket `ticket` (or crashed, as the library says).
    fn acked(
        &mut self,
        page: PageNo,
        ticket: Ticket,
        site: SiteId,
        now_ms: u64,
    ) -> (Out<D>, Option<PageNo>) {
        let p = self.page(page);
        match p.waiting.as_mut() {
            Some(w) if w.ticket == ticket && w.acks.contains(&site) => {
                w.acks.remove(&site);
                return self.install_if_acked(page, now_ms);
            }
            None if p.asked == Some(Want::Write)
                && ticket > p.installed
                && p.early.len() < MAX_EARLY_ACKS =>
            {
                p.early.insert((ticket, site));
            }
            _ => self.counters.refused += 1,
        }
        (Vec::new(), None)
    }

    fn install_if_acked(&mut self, page: PageNo, now_ms: u64) -> (Out<D>, Option<PageNo>) {
        let library = self.library;
        let delta = self.delta_ms;
        let p = self.page(page);
        if p.waiting.as_ref().is_none_or(|w| !w.acks.is_empty()) {
            return (Vec::new(), None);
        }
        let w = p.waiting.take().expect("checked");
        p.access = w.grant.access();
        let moved = w.data.is_some();
        if let Some(data) = w.data {
            p.data = Some(data);
        }
        p.hold_until = now_ms.saturating_add(delta);
        p.used = false;
        p.asked = None;
        p.installed = w.ticket;
        if moved {
            self.counters.installs += 1;
        } else {
            self.counters.upgrades += 1;
        }
        let ticket = w.ticket;
        (vec![(library, Msg::Done { page, ticket })], Some(page))
    }

    fn releasable(p: &Page<D>, now_ms: u64) -> bool {
        p.used && now_ms >= p.hold_until
    }

    /// Carries out an order of the library's now.
    fn carry_out(&mut self, msg: Msg<D>, out: &mut Out<D>) {
        let library = self.library;
        match msg {
            Msg::Invalidate {
                page,
                ticket,
                ack_to,
            } => {
                let p = self.page(page);
                p.access = Access::None;
                p.data = None;
                self.counters.invalidated += 1;
                out.push(match ack_to {
                    Some(r) => (r, Msg::Ack { page, ticket }),
                    None => (library, Msg::Invalidated { page, ticket }),
                });
            }
            Msg::Send {
                page,
                to,
                grant,
                ticket,
                wait,
            } => {
                let p = self.page(page);
                let Some(data) = p.data.clone().filter(|_| p.access != Access::None) else {
                    // The library thinks this site holds the newest copy, and it does not.
                    self.counters.refused += 1;
                    return;
                };
                match grant {
                    Want::Read => p.access = Access::Read,
                    Want::Write => {
                        p.access = Access::None;
                        p.ghost = p.data.take().map(|d| (ticket, d));
                    }
                }
                self.counters.sent += 1;
                out.push((
                    to,
                    Msg::Page {
                        page,
                        grant,
                        ticket,
                        data,
                        wait,
                    },
                ));
            }
            Msg::Restore { page, ticket } => {
                let p = self.page(page);
                match p.ghost.take() {
                    Some((t, data)) if t == ticket => {
                        p.access = Access::Write;
                        p.data = Some(data);
                        p.used = true;
                        // A request of its own meanwhile is answered by the library with a
                        // grant of what it now has.
                        self.counters.restored += 1;
                        self.restored.push(page);
                    }
                    other => {
                        p.ghost = other;
                        self.counters.refused += 1;
                    }
                }
            }
            _ => unreachable!("only orders are carried out"),
        }
    }

    /// Time has passed (or a page was used): carries out the orders whose pages' windows
    /// have passed.
    pub fn tick(&mut self, now_ms: u64) -> Out<D> {
        let mut out = Vec::new();
        let ready: Vec<PageNo> = self
            .waiting_orders
            .iter()
            .copied()
            .filter(|n| Self::releasable(&self.pages[n], now_ms))
            .collect();
        for n in ready {
            self.waiting_orders.remove(&n);
            while let Some(msg) = self.page(n).deferred.pop_front() {
                self.counters.deferred += 1;
                self.carry_out(msg, &mut out);
                // After an order the page is no longer held here: any next one goes at once.
            }
        }
        out
    }

    /// Whether an order of the library's waits here (for a window, or for its page's use).
    pub fn has_deferred(&self) -> bool {
        !self.waiting_orders.is_empty()
    }

    /// When [`Site::tick`] next has something to do, if only time is missing (`None`: nothing
    /// waits, or what waits needs a page to be used first).
    pub fn next_deadline(&self) -> Option<u64> {
        self.waiting_orders
            .iter()
            .map(|n| &self.pages[n])
            .filter(|p| p.used)
            .map(|p| p.hold_until)
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An order that arrives within the window, or before the faulting process used its page,
    /// waits for both; a page nobody asked for, and orders from anyone but the library, change
    /// nothing.
    #[test]
    fn orders_wait_for_the_window_and_the_use() {
        let mut s: Site<u8> = Site::new(2, 1, false, 10);
        assert!(matches!(s.fault(0, Want::Write), Fault::Ask(1, _)));
        assert_eq!(s.fault(0, Want::Write), Fault::Wait);
        let (out, woke) = s.on_msg(
            3,
            Msg::Page {
                page: 0,
                grant: Want::Write,
                ticket: 4,
                data: 7,
                wait: vec![],
            },
            100,
        );
        assert_eq!(woke, Some(0));
        assert_eq!(out, [(1, Msg::Done { page: 0, ticket: 4 })]);
        assert_eq!(s.access(0), Access::Write);
        // The library wants it for site 3, at 105: not yet (window, and not used).
        let send = Msg::Send {
            page: 0,
            to: 3,
            grant: Want::Read,
            ticket: 5,
            wait: vec![],
        };
        assert!(s.on_msg(1, send, 105).0.is_empty());
        assert_eq!(s.next_deadline(), None, "waits for its use first");
        s.accessed(0);
        assert_eq!(s.next_deadline(), Some(110));
        assert!(s.tick(109).is_empty());
        let out = s.tick(110);
        assert_eq!(
            out,
            [(
                3,
                Msg::Page {
                    page: 0,
                    grant: Want::Read,
                    ticket: 5,
                    data: 7,
                    wait: vec![]
                }
            )]
        );
        assert_eq!(s.access(0), Access::Read);
        // An invalidation from a site that is not the library; a page not asked for.
        assert!(s
            .on_msg(
                3,
                Msg::Invalidate {
                    page: 0,
                    ticket: 6,
                    ack_to: None
                },
                200
            )
            .0
            .is_empty());
        let forged = Msg::Page {
            page: 1,
            grant: Want::Write,
            ticket: 1,
            data: 9,
            wait: vec![],
        };
        assert_eq!(s.on_msg(3, forged, 200), (vec![], None));
        assert_eq!(s.access(1), Access::None);
        assert_eq!(s.counters.refused, 2);
        assert_eq!(s.access(0), Access::Read);
    }

    /// A write copy sent away and got back later: the `Forget` of the first transfer, arriving
    /// after, is no `Restore` (the runtime put the old contents back over newer writes when it
    /// could not tell them apart).
    #[test]
    fn a_forgotten_copy_is_not_a_restored_one() {
        let mut s: Site<u8> = Site::new(2, 1, false, 0);
        assert!(matches!(s.fault(0, Want::Write), Fault::Ask(1, _)));
        let page = |ticket, data| Msg::Page {
            page: 0,
            grant: Want::Write,
            ticket,
            data,
            wait: vec![],
        };
        s.on_msg(3, page(1, 10), 0);
        s.accessed(0);
        let send = Msg::Send {
            page: 0,
            to: 3,
            grant: Want::Write,
            ticket: 2,
            wait: vec![],
        };
        assert_eq!(s.on_msg(1, send, 1).0.len(), 1);
        assert!(s.has_ghost(0));
        // Back here before the library's Forget of ticket 2 arrives.
        assert!(matches!(s.fault(0, Want::Write), Fault::Ask(1, _)));
        s.on_msg(3, page(3, 30), 2);
        s.on_msg(1, Msg::Forget { page: 0, ticket: 2 }, 3);
        assert!(!s.has_ghost(0));
        assert_eq!(s.take_restored(), Vec::<PageNo>::new());
        assert_eq!(s.data(0), Some(&mut 30));
        // A Restore of a copy that is no longer kept changes nothing either.
        s.on_msg(1, Msg::Restore { page: 0, ticket: 2 }, 4);
        assert_eq!(s.take_restored(), Vec::<PageNo>::new());
    }

    #[test]
    fn the_creator_holds_every_page_at_first() {
        let mut c: Site<u8> = Site::new(1, 1, true, 0);
        assert_eq!(c.access(42), Access::Read);
        assert_eq!(c.fault(42, Want::Read), Fault::Ready);
        assert_eq!(c.data(42), Some(&mut 0));
        let out = c
            .on_msg(
                1,
                Msg::Invalidate {
                    page: 42,
                    ticket: 1,
                    ack_to: None,
                },
                0,
            )
            .0;
        assert_eq!(
            out,
            [(
                1,
                Msg::Invalidated {
                    page: 42,
                    ticket: 1
                }
            )]
        );
        assert_eq!(c.access(42), Access::None);
    }

    /// A write's answer waits for every acknowledgement named with it, whichever comes first;
    /// acknowledgements from sites not named, or for another ticket, change nothing; the
    /// library may excuse a crashed site.
    #[test]
    fn a_write_is_installed_after_the_last_acknowledgement() {
        let mut s: Site<u8> = Site::new(2, 1, false, 0);
        assert!(matches!(s.fault(0, Want::Write), Fault::Ask(1, _)));
        // Site 4's acknowledgement overtakes the page; one for another ticket too.
        assert_eq!(
            s.on_msg(4, Msg::Ack { page: 0, ticket: 3 }, 0),
            (vec![], None)
        );
        assert_eq!(
            s.on_msg(5, Msg::Ack { page: 0, ticket: 2 }, 0),
            (vec![], None)
        );
        let page = Msg::Page {
            page: 0,
            grant: Want::Write,
            ticket: 3,
            data: 9,
            wait: vec![4, 5, 6],
        };
        assert_eq!(s.on_msg(1, page, 1), (vec![], None));
        assert!(s.holds_arrived(0));
        assert_eq!(s.access(0), Access::None);
        assert_eq!(s.fault(0, Want::Write), Fault::Wait);
        // Not named; named but again; the library's excuse for 6 from anyone else.
        assert_eq!(
            s.on_msg(7, Msg::Ack { page: 0, ticket: 3 }, 1),
            (vec![], None)
        );
        assert_eq!(
            s.on_msg(4, Msg::Ack { page: 0, ticket: 3 }, 1),
            (vec![], None)
        );
        let excuse = Msg::Excuse {
            page: 0,
            ticket: 3,
            site: 6,
        };
        assert_eq!(s.on_msg(5, excuse.clone(), 1), (vec![], None));
        assert_eq!(
            s.on_msg(5, Msg::Ack { page: 0, ticket: 3 }, 2),
            (vec![], None)
        );
        assert_eq!(s.access(0), Access::None);
        let (out, woke) = s.on_msg(1, excuse, 3);
        assert_eq!(woke, Some(0));
        assert_eq!(out, [(1, Msg::Done { page: 0, ticket: 3 })]);
        assert_eq!((s.access(0), s.data(0).copied()), (Access::Write, Some(9)));
        assert!(!s.holds_arrived(0));
        assert_eq!(s.counters.refused, 3);
    }
}
