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
    /// Waiting for these sites to drop their copies (acknowledged to the library).
    Invalidating(BTreeSet<SiteId>),
    /// The page (or the grant) is on its way; waiting for the requester's `Done`. `acks`:
    /// the sites told to drop their copies and acknowledge to the requester, which installs
    /// the page once it has heard from them all (kept here for crashes).
    Installing { acks: BTreeSet<SiteId> },
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Active {
    site: SiteId,
    want: Want,
    ticket: Ticket,
    phase: Phase,
    /// The site ordered to send the page (`None`: nothing moves, a grant).
    source: Option<SiteId>,
    /// The source crashed while the page was on its way: the requester was asked whether it
    /// came (`Probe`).
    probing: bool,
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
    /// Its only copy went with a crashed site: every request is answered `Lost`.
    lost: bool,
}

/// What the library dropped, by reason.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Counters {
    pub requests: u64,
    pub requests_not_member: u64,
    pub requests_repeated: u64,
    /// Requests the directory says need nothing (the site has that access already: its write
    /// copy was given back while the request was on its way), answered with a grant.
    pub requests_confused: u64,
    pub invalidations: u64,
    pub upgrades: u64,
    pub transfers: u64,
    /// Acknowledgements and `Done`s that match no request being served, and anything from a
    /// site declared down.
    pub stale: u64,
    pub sites_down: u64,
    /// Pages whose only copy went with a crashed site.
    pub pages_lost: u64,
    /// Write copies given back to their sender after the requester crashed.
    pub restores: u64,
    /// Requesters asked whether a crashed source's page reached them.
    pub probes: u64,
    /// Requesters told not to wait for a crashed site's acknowledgement.
    pub excused: u64,
    /// Copies invalidated again, acknowledged here, after their requester crashed.
    pub reinvalidations: u64,
}

/// A segment's library.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Library {
    /// The creator: initially the clock site of every page (a zero page it holds). `None`
    /// in a library rebuilt after the creator's crash ([`Library::rebuild`]): a page no
    /// survivor reported went with it, lost.
    creator: Option<SiteId>,
    /// The sites admitted; `None`: every site the transport lets speak (the cluster's
    /// authenticated members).
    members: Option<BTreeSet<SiteId>>,
    pages: BTreeMap<PageNo, Page>,
    next_ticket: Ticket,
    /// Sites declared down: what they send is ignored.
    dead: BTreeSet<SiteId>,
    /// A write invalidating at most this many copies has them acknowledged to its requester
    /// directly (three message hops: request, invalidations, acknowledgements); more, to the
    /// library (four: the grant waits for the last acknowledgement here).
    direct_max: usize,
    pub counters: Counters,
}

/// Messages to send: (to whom, what).
pub type Out<D> = Vec<(SiteId, Msg<D>)>;

/// The most sites a requester is told to collect acknowledgements from itself (a frame
/// names them, one byte counts them). A write that must invalidate more copies has them
/// acknowledged to the library, which grants once it has them all (a message hop more).
pub const MAX_WAIT: usize = 255;

/// A page's entry, made on first use: the creator holds it (a zero page, checked in); with
/// no creator (it crashed), nobody does: lost.
fn page_of(pages: &mut BTreeMap<PageNo, Page>, creator: Option<SiteId>, page: PageNo) -> &mut Page {
    pages.entry(page).or_insert_with(|| Page {
        clock: creator.unwrap_or(SiteId::MAX),
        mode: if creator.is_some() {
            Access::Read
        } else {
            Access::None
        },
        copies: creator.into_iter().collect(),
        queue: VecDeque::new(),
        active: None,
        lost: creator.is_none(),
    })
}

/// Where a ticket's era starts: a library rebuilt after a crash numbers its requests in the
/// next era, so that a site tells an order or a page of the crashed library's time (still on
/// its way) from one of the new library's, and refuses it.
pub const ERA_SHIFT: u32 = 40;

/// The era a ticket belongs to.
pub fn era_of(ticket: Ticket) -> u64 {
    ticket >> ERA_SHIFT
}

/// What one site holds of one page, as it reports it to a library being rebuilt
/// ([`crate::Site::library_down`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Held {
    pub page: PageNo,
    pub access: Access,
    /// The write copy it sent away and keeps (the transfer's ticket).
    pub ghost: Option<Ticket>,
    /// The newest ticket it installed the page under (0: none).
    pub installed: Ticket,
    /// It was told the page is lost.
    pub lost: bool,
}

/// A site's report to a library being rebuilt: its era and what it holds.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Report {
    pub era: u64,
    pub pages: Vec<Held>,
}

impl Library {
    /// The library of a segment created by `creator`, which admits `members` (the creator
    /// always).
    pub fn new(creator: SiteId, members: impl IntoIterator<Item = SiteId>) -> Self {
        let mut members: BTreeSet<SiteId> = members.into_iter().collect();
        members.insert(creator);
        Self {
            creator: Some(creator),
            members: Some(members),
            pages: BTreeMap::new(),
            next_ticket: 1,
            dead: BTreeSet::new(),
            direct_max: MAX_WAIT,
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

    /// Writes invalidating more than `max` copies (at most [`MAX_WAIT`]) have them
    /// acknowledged to the library rather than to their requester.
    pub fn set_direct_acks(&mut self, max: usize) {
        self.direct_max = max.min(MAX_WAIT);
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
            None => match self.creator {
                Some(c) => (c, Access::Read, vec![c]),
                None => (SiteId::MAX, Access::None, vec![]),
            },
        }
    }

    /// Whether `page` was lost with a crashed site.
    pub fn lost(&self, page: PageNo) -> bool {
        match self.pages.get(&page) {
            Some(p) => p.lost,
            None => self.creator.is_none(),
        }
    }

    /// The library's era (the era of the tickets it gives).
    pub fn era(&self) -> u64 {
        era_of(self.next_ticket)
    }

    /// The library of a segment whose library site crashed, rebuilt at site `me` from every
    /// surviving site's report (MIRAGE+ has no such step; GMS §6 names it for its initiator,
    /// unbuilt there): the survivors' own state is the truth. `members`: the sites
    /// admitted from now on (the reporters: the crashed library's list went with it).
    ///
    /// Per page: a write copy someone holds is the page (every kept copy sent away is
    /// older: forgotten); else the read copies (all alike); else the newest write copy kept by
    /// the site that sent it away, if no survivor installed it or anything after it (given
    /// back, `Restore`; any other kept copy forgotten); else nobody has it — it was at the crashed site only, lost, as is every
    /// page nobody reported. Its tickets are of the era after every reporter's, so that the
    /// crashed library's orders and the pages sent on them, still on their way, are refused
    /// (a site reporting has stopped taking them already).
    pub fn rebuild<D>(
        me: SiteId,
        reports: &[(SiteId, Report)],
        members: impl IntoIterator<Item = SiteId>,
    ) -> (Self, Out<D>) {
        let era = reports.iter().map(|(_, r)| r.era).max().unwrap_or(0) + 1;
        let mut members: BTreeSet<SiteId> = members.into_iter().collect();
        members.insert(me);
        let mut lib = Self {
            creator: None,
            members: Some(members),
            pages: BTreeMap::new(),
            next_ticket: (era << ERA_SHIFT) + 1,
            dead: BTreeSet::new(),
            direct_max: MAX_WAIT,
            counters: Counters::default(),
        };
        let mut out = Vec::new();
        let mut by_page: BTreeMap<PageNo, Vec<(SiteId, Held)>> = BTreeMap::new();
        for (site, r) in reports {
            for h in &r.pages {
                by_page.entry(h.page).or_default().push((*site, *h));
            }
        }
        for (page, held) in by_page {
            let writer = held.iter().find(|(_, h)| h.access == Access::Write);
            let readers: BTreeSet<SiteId> = held
                .iter()
                .filter(|(_, h)| h.access == Access::Read)
                .map(|&(s, _)| s)
                .collect();
            // A kept copy whose transfer someone installed, or that a later install followed
            // (a page's requests are served one after another), is older than the page.
            let installed = held.iter().map(|(_, h)| h.installed).max().unwrap_or(0);
            let newest_ghost = held
                .iter()
                .filter_map(|&(s, h)| h.ghost.map(|t| (t, s)))
                .filter(|&(t, _)| t > installed)
                .max();
            let mut entry = Page {
                clock: SiteId::MAX,
                mode: Access::None,
                copies: BTreeSet::new(),
                queue: VecDeque::new(),
                active: None,
                lost: false,
            };
            let mut restore = None;
            if let Some(&(w, _)) = writer {
                entry.clock = w;
                entry.mode = Access::Write;
                entry.copies.insert(w);
            } else if let Some(&r) = readers.first() {
                entry.clock = r;
                entry.mode = Access::Read;
                entry.copies = readers;
            } else if let Some((t, s)) = newest_ghost {
                entry.clock = s;
                entry.mode = Access::Write;
                entry.copies.insert(s);
                restore = Some((s, t));
            } else {
                entry.lost = true;
                lib.counters.pages_lost += 1;
            }
            for &(s, h) in &held {
                match h.ghost {
                    Some(t) if restore == Some((s, t)) => {
                        out.push((s, Msg::Restore { page, ticket: t }));
                        lib.counters.restores += 1;
                    }
                    Some(t) => out.push((s, Msg::Forget { page, ticket: t })),
                    None => {}
                }
            }
            lib.pages.insert(page, entry);
        }
        (lib, out)
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
        if self.dead.contains(&from) {
            self.counters.stale += 1;
            return out;
        }
        match msg {
            Msg::Request { page, want } => self.request(from, page, want, &mut out),
            Msg::Invalidated { page, ticket } => self.invalidated(from, page, ticket, &mut out),
            Msg::Done { page, ticket } => self.done(from, page, ticket, &mut out),
            Msg::Missing { page, ticket } => self.missing(from, page, ticket, &mut out),
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
            if p.lost {
                self.next_ticket += 1;
                out.push((site, Msg::Lost { page, ticket }));
                continue;
            }
            let has = p.copies.contains(&site);
            let access = if !has {
                Access::None
            } else if p.mode == Access::Write {
                Access::Write
            } else {
                Access::Read
            };
            if access >= want.access() {
                // It has what it asks for: its write copy was given back (`Restore`) while
                // this request was on its way. Told so, with nothing to wait for.
                self.counters.requests_confused += 1;
                self.next_ticket += 1;
                let wait = Vec::new();
                out.push((site, Msg::Grant { page, ticket, wait }));
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
                            wait: Vec::new(),
                        },
                    ));
                    p.copies.insert(site);
                    p.mode = Access::Read;
                    p.active = Some(Active {
                        site,
                        want,
                        ticket,
                        phase: Phase::Installing {
                            acks: BTreeSet::new(),
                        },
                        source: Some(p.clock),
                        probing: false,
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
                    self.counters.invalidations += drop.len() as u64;
                    if drop.len() <= self.direct_max {
                        // The copies are dropped while the page (or the grant) travels; the
                        // requester collects the acknowledgements and installs after the last.
                        for &s in &drop {
                            let ack_to = Some(site);
                            out.push((
                                s,
                                Msg::Invalidate {
                                    page,
                                    ticket,
                                    ack_to,
                                },
                            ));
                        }
                        let wait: Vec<SiteId> = drop.iter().copied().collect();
                        let source = if has {
                            out.push((site, Msg::Grant { page, ticket, wait }));
                            self.counters.upgrades += 1;
                            None
                        } else {
                            let grant = Want::Write;
                            out.push((
                                clock,
                                Msg::Send {
                                    page,
                                    to: site,
                                    grant,
                                    ticket,
                                    wait,
                                },
                            ));
                            self.counters.transfers += 1;
                            Some(clock)
                        };
                        p.active = Some(Active {
                            site,
                            want,
                            ticket,
                            phase: Phase::Installing { acks: drop },
                            source,
                            probing: false,
                        });
                        p.clock = site;
                        p.mode = Access::Write;
                        p.copies = BTreeSet::from([site]);
                        return;
                    }
                    for &s in &drop {
                        out.push((
                            s,
                            Msg::Invalidate {
                                page,
                                ticket,
                                ack_to: None,
                            },
                        ));
                    }
                    p.active = Some(Active {
                        site,
                        want,
                        ticket,
                        phase: Phase::Invalidating(drop),
                        source: None,
                        probing: false,
                    });
                    self.invalidations_done(page, out);
                }
            }
            return;
        }
    }

    /// Once every copy to drop is gone: the write request's grant or transfer.
    fn invalidations_done<D>(&mut self, page: PageNo, out: &mut Out<D>) {
        let dead = &self.dead;
        let p = page_of(&mut self.pages, self.creator, page);
        let Some(a) = p.active.as_ref() else { return };
        if !matches!(&a.phase, Phase::Invalidating(w) if w.is_empty()) {
            return;
        }
        if dead.contains(&a.site) {
            // Its requester crashed: every copy it wanted gone is gone; nothing to grant. A
            // write copy sent to it goes back to its sender (kept there: a ghost).
            let (ticket, restore) = (a.ticket, a.source.filter(|s| !dead.contains(s)));
            p.active = None;
            if let Some(src) = restore {
                p.clock = src;
                p.mode = Access::Write;
                p.copies = BTreeSet::from([src]);
                out.push((src, Msg::Restore { page, ticket }));
                self.counters.restores += 1;
                return self.serve(page, out);
            }
            // The clock's copy may have been among them (an upgrade): another copy, or lost.
            if !p.copies.contains(&p.clock) {
                match p.copies.first().copied() {
                    Some(c) => {
                        p.clock = c;
                        p.mode = Access::Read;
                    }
                    None => return self.lose(page, out),
                }
            }
            return self.serve(page, out);
        }
        let dead_clock = !p.copies.contains(&a.site) && !p.copies.contains(&p.clock);
        if dead_clock {
            // The copy it would have come from went with a crashed site, and every other was
            // just dropped for this write.
            self.lose(page, out);
            return;
        }
        let p = self.page(page);
        let Some(a) = p.active.as_mut() else { return };
        a.phase = Phase::Installing {
            acks: BTreeSet::new(),
        };
        let (site, ticket, wait) = (a.site, a.ticket, Vec::new());
        if p.copies.contains(&site) {
            out.push((site, Msg::Grant { page, ticket, wait }));
            self.counters.upgrades += 1;
        } else {
            a.source = Some(p.clock);
            out.push((
                p.clock,
                Msg::Send {
                    page,
                    to: site,
                    grant: Want::Write,
                    ticket,
                    wait,
                },
            ));
            self.counters.transfers += 1;
        }
        let p = self.page(page);
        p.clock = site;
        p.mode = Access::Write;
        p.copies = BTreeSet::from([site]);
    }

    /// The page's only copy is gone: the request being served (if its requester lives) and
    /// every later one are answered `Lost`.
    fn lose<D>(&mut self, page: PageNo, out: &mut Out<D>) {
        let p = self.page(page);
        p.lost = true;
        p.copies.clear();
        p.mode = Access::None;
        let active = p.active.take();
        self.counters.pages_lost += 1;
        if let Some(a) = active.filter(|a| !self.dead.contains(&a.site)) {
            out.push((
                a.site,
                Msg::Lost {
                    page,
                    ticket: a.ticket,
                },
            ));
        }
        self.serve(page, out);
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
        let dead = &self.dead;
        let p = page_of(&mut self.pages, self.creator, page);
        match &p.active {
            Some(a)
                if a.site == from
                    && a.ticket == ticket
                    && matches!(a.phase, Phase::Installing { .. }) =>
            {
                if dead.contains(&p.clock) {
                    // Its source crashed after sending: the requester's copy is the clock's.
                    p.clock = from;
                }
                // A write copy's sender kept it in case the requester crashed: it may go.
                if let Some(src) = a.source.filter(|&s| a.want == Want::Write && s != from) {
                    out.push((src, Msg::Forget { page, ticket }));
                }
                p.active = None;
                self.serve(page, out);
            }
            _ => self.counters.stale += 1,
        }
    }

    /// The requester did not get the page of a source that crashed: another copy sends it
    /// (a read, while one is left), or the page is lost.
    fn missing<D>(&mut self, from: SiteId, page: PageNo, ticket: Ticket, out: &mut Out<D>) {
        let next = self.next_ticket;
        let p = self.page(page);
        let ours = matches!(&p.active,
            Some(a) if a.site == from && a.ticket == ticket && a.probing);
        if !ours {
            self.counters.stale += 1;
            return;
        }
        let a = p.active.as_mut().expect("checked");
        let other = p.copies.iter().copied().find(|&c| c != from);
        match (a.want, other) {
            (Want::Read, Some(src)) => {
                // A new ticket: the lost one may still arrive, and is refused.
                a.ticket = next;
                a.source = Some(src);
                a.probing = false;
                p.clock = src;
                out.push((
                    src,
                    Msg::Send {
                        page,
                        to: from,
                        grant: Want::Read,
                        ticket: next,
                        wait: Vec::new(),
                    },
                ));
                self.next_ticket += 1;
                self.counters.transfers += 1;
            }
            _ => self.lose(page, out),
        }
    }

    /// Site `dead` crashed (the membership says so, or it could not be reached): its copies
    /// are gone, its requests dropped, what it was doing for others finished or undone. A page
    /// it held alone is lost. Everything it sends from now on is ignored.
    pub fn site_down<D>(&mut self, dead: SiteId) -> Out<D> {
        let mut out = Vec::new();
        if !self.dead.insert(dead) {
            return out;
        }
        self.counters.sites_down += 1;
        let pages: Vec<PageNo> = self.pages.keys().copied().collect();
        for page in pages {
            self.page_site_down(page, dead, &mut out);
        }
        out
    }

    fn page_site_down<D>(&mut self, page: PageNo, dead: SiteId, out: &mut Out<D>) {
        let p = page_of(&mut self.pages, self.creator, page);
        p.queue.retain(|&(s, _)| s != dead);
        let held = p.copies.remove(&dead);
        let was_clock = p.clock == dead;
        match p.active.take() {
            None => {
                p.active = None;
                if was_clock && held {
                    match p.copies.first().copied() {
                        Some(c) if p.mode == Access::Read => p.clock = c,
                        _ => self.lose(page, out),
                    }
                }
            }
            Some(a) if a.site == dead => match a.phase {
                Phase::Invalidating(_) => {
                    // The copies told to go are going: wait for them all (a request served
                    // before would find them still there), then finish without a grant.
                    p.active = Some(a);
                    self.invalidations_done(page, out);
                }
                Phase::Installing { ref acks }
                    if a.want == Want::Write && acks.iter().any(|s| !self.dead.contains(s)) =>
                {
                    // Copies it was collecting acknowledgements for may still be there (their
                    // acknowledgements would go to the crashed site): told again, acknowledged
                    // here this time, before the page's next request is served or a write
                    // copy given back. Dropping a copy twice is harmless.
                    let left: BTreeSet<SiteId> = acks
                        .iter()
                        .copied()
                        .filter(|s| !self.dead.contains(s))
                        .collect();
                    for &s in &left {
                        let ticket = a.ticket;
                        out.push((
                            s,
                            Msg::Invalidate {
                                page,
                                ticket,
                                ack_to: None,
                            },
                        ));
                    }
                    self.counters.reinvalidations += left.len() as u64;
                    p.clock = dead;
                    p.mode = Access::Read;
                    p.copies = left.clone();
                    p.active = Some(Active {
                        phase: Phase::Invalidating(left),
                        ..a
                    });
                }
                Phase::Installing { .. } => match (a.want, a.source) {
                    (Want::Write, Some(src)) if !self.dead.contains(&src) => {
                        // It sent its write copy and kept it: back to it.
                        p.clock = src;
                        p.mode = Access::Write;
                        p.copies = BTreeSet::from([src]);
                        out.push((
                            src,
                            Msg::Restore {
                                page,
                                ticket: a.ticket,
                            },
                        ));
                        self.counters.restores += 1;
                        self.serve(page, out);
                    }
                    (Want::Write, _) => self.lose(page, out),
                    (Want::Read, _) => {
                        // The source kept its copy.
                        if was_clock {
                            return self.lose(page, out);
                        }
                        self.serve(page, out);
                    }
                },
            },
            Some(mut a) => {
                match &mut a.phase {
                    Phase::Invalidating(waiting) => {
                        waiting.remove(&dead);
                        p.active = Some(a);
                        if was_clock && p.copies.is_empty() {
                            // Nothing left to send the page from.
                            return self.lose(page, out);
                        }
                        self.invalidations_done(page, out);
                    }
                    Phase::Installing { acks } => {
                        if acks.remove(&dead) {
                            out.push((
                                a.site,
                                Msg::Excuse {
                                    page,
                                    ticket: a.ticket,
                                    site: dead,
                                },
                            ));
                            self.counters.excused += 1;
                        }
                        if a.source == Some(dead) {
                            a.probing = true;
                            out.push((
                                a.site,
                                Msg::Probe {
                                    page,
                                    ticket: a.ticket,
                                },
                            ));
                            self.counters.probes += 1;
                        }
                        p.active = Some(a);
                    }
                }
            }
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
                    ticket: 1,
                    wait: vec![]
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

    /// Two readers of page 5 (sites 2 and 3) besides the creator, site 1.
    fn two_readers(direct_acks: usize) -> Library {
        let mut l = Library::new(1, [2, 3]);
        l.set_direct_acks(direct_acks);
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
        l
    }

    /// An upgrade invalidates every other copy, the clock site's included, acknowledged to
    /// the requester, and grants at once without moving the page: the requester installs
    /// after the last acknowledgement. The next request waits for its Done.
    #[test]
    fn an_upgrade_invalidates_all_others_acknowledged_to_the_requester() {
        let mut l = two_readers(MAX_WAIT);
        let write = Msg::Request {
            page: 5,
            want: Want::Write,
        };
        let out: Vec<(SiteId, M)> = l.on_msg(2, write);
        let ticket = 3;
        let invalidate = |s| {
            (
                s,
                Msg::Invalidate {
                    page: 5,
                    ticket,
                    ack_to: Some(2),
                },
            )
        };
        let wait = vec![1, 3];
        let grant = (
            2,
            Msg::Grant {
                page: 5,
                ticket,
                wait,
            },
        );
        assert_eq!(out, [invalidate(1), invalidate(3), grant]);
        assert_eq!(l.holders(5), (2, Access::Write, vec![2]));
        let read = Msg::Request {
            page: 5,
            want: Want::Read,
        };
        assert!(l.on_msg::<u8>(3, read).is_empty(), "queued");
        let out: Vec<(SiteId, M)> = l.on_msg(2, Msg::Done { page: 5, ticket });
        assert!(matches!(out[..], [(2, Msg::Send { to: 3, .. })]), "{out:?}");
    }

    /// Reader 3 crashes while the requester collects acknowledgements: the requester is
    /// excused from waiting for it. Then the requester crashes: the copies it was told about
    /// are invalidated again, acknowledged to the library, before anything else is served.
    #[test]
    fn crashes_while_acknowledgements_are_collected() {
        let mut l = two_readers(MAX_WAIT);
        let write = Msg::Request {
            page: 5,
            want: Want::Write,
        };
        l.on_msg::<u8>(2, write);
        let ticket = 3;
        let out: Vec<(SiteId, M)> = l.site_down(3);
        let excuse = Msg::Excuse {
            page: 5,
            ticket,
            site: 3,
        };
        assert_eq!(out, [(2, excuse)]);
        let out: Vec<(SiteId, M)> = l.site_down(2);
        let again = Msg::Invalidate {
            page: 5,
            ticket,
            ack_to: None,
        };
        assert_eq!(out, [(1, again)]);
        assert!(l.busy(5));
        // An upgrade's requester held the page: once site 1 drops its copy, nobody does.
        let out: Vec<(SiteId, M)> = l.on_msg(1, Msg::Invalidated { page: 5, ticket });
        assert!(out.is_empty(), "{out:?}");
        assert!(l.lost(5));
    }

    /// With direct acknowledgements off (more copies than a frame names), an upgrade's
    /// invalidations are acknowledged to the library, which grants after the last.
    #[test]
    fn an_upgrade_through_the_library_grants_after_every_acknowledgement() {
        let mut l = two_readers(0);
        let out: Vec<(SiteId, M)> = l.on_msg(
            2,
            Msg::Request {
                page: 5,
                want: Want::Write,
            },
        );
        let to: Vec<SiteId> = out.iter().map(|o| o.0).collect();
        assert_eq!(to, [1, 3]);
        assert!(out
            .iter()
            .all(|o| matches!(o.1, Msg::Invalidate { ack_to: None, .. })));
        let ticket = 3;
        assert!(l
            .on_msg::<u8>(1, Msg::Invalidated { page: 5, ticket })
            .is_empty());
        let out: Vec<(SiteId, M)> = l.on_msg(3, Msg::Invalidated { page: 5, ticket });
        let wait = vec![];
        assert_eq!(
            out,
            [(
                2,
                Msg::Grant {
                    page: 5,
                    ticket,
                    wait
                }
            )]
        );
        assert_eq!(l.holders(5), (2, Access::Write, vec![2]));
    }
}
