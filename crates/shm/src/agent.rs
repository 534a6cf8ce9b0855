//! A machine's agent for its segments (MIRAGE+ §3): one thread that serves every local
//! process's faults on every segment attached here, carries out the library's orders, and,
//! for the segments created here, is their library site.
//!
//! The decisions are [`netram_dsm`]'s state machines; this is their I/O. A fault read from a
//! process's userfaultfd becomes [`Site::fault`]; a message for this machine goes to the
//! segment's [`Site`] or [`Library`]; what they answer is carried out on the machine's copy
//! ([`crate::memory`]: write-protect, read, punch, write, wake) and sent — to the network, or
//! straight back in when it is for this machine (the library's own site). One thread, so no
//! lock: the protocol's steps for a segment happen in the order they are taken, and a fault
//! is never served half-way through an order.
//!
//! The network is a seam ([`Agent::new`]'s `net`: a frame for a site), so the same agent runs
//! between threads of one test and between daemons.
//!
//! The time window: a page installed here is held for at least [`MIN_HOLD_US`] (or the
//! segment's Δ if longer) after the faulting thread is woken, so that it runs its access
//! before the page can be taken again — MIRAGE+ §5.4's cure for pages stolen before use,
//! as time: the kernel does not report the access itself. 100 µs covers a wake-up on these
//! machines (~60 µs, MACHINE-NOTES.md); 1 ms, tried first, made every read of a page just
//! written elsewhere wait the millisecond out (`netram bench dsm`: 1.4 ms read faults). The
//! agent's clock, which the protocol's state machines are fed, counts microseconds.

mod takeover;

use crate::memory::{Copy, View};
use crate::wire::{self, Data, Frame, Meta};
use netram_dsm::{Fault, Library, Msg, PageNo, Site, SiteId, Want};
use netram_proto::compress::{Packed, Rule, Skip};
use netram_proto::PAGE_SIZE;
use netram_uffd::sys::Event;
use rustix::fd::{AsFd, OwnedFd};
use rustix::io::Errno;
use std::collections::{HashMap, VecDeque};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The shortest time a page installed here is kept (see the module comment).
pub const MIN_HOLD_US: u64 = 100;

/// A segment's identity in the cluster.
pub type SegmentId = u64;

/// What the agent did and refused, by reason.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counters {
    pub faults: u64,
    /// Faults served from this machine's copy (the page was here, or a zero page).
    pub faults_local: u64,
    pub requests: u64,
    pub installs: u64,
    pub upgrades: u64,
    pub pages_sent: u64,
    pub zero_pages_sent: u64,
    pub invalidated: u64,
    /// Frames refused: undecodable, a bad checksum, for a segment not attached here or a page
    /// past its end.
    pub frames_refused: u64,
    /// Views dropped because their process's userfaultfd failed (the process is gone).
    pub views_lost: u64,
    pub lookups: u64,
    /// Pages found lost with a crashed machine (each access to one gets SIGBUS).
    pub pages_lost: u64,
    /// Write copies taken back after their requester crashed.
    pub restored: u64,
    /// Machines declared down to this agent (their copies gone, their requests dropped).
    pub sites_down: u64,
    /// Lookups answered ABSENT because the asker is not admitted to the segment.
    pub lookups_refused: u64,
    /// Names taken away here (System V's IPC_RMID).
    pub unlinked: u64,
    /// Connections from other daemons that ended while the agent read them ([`Feed`]).
    pub feeds_ended: u64,
    /// Connections refused: more than [`MAX_FEEDS`].
    pub feeds_refused: u64,
    /// Pages sent compressed ([`Agent::set_compression`]), and the bytes that saved.
    pub pages_compressed: u64,
    pub bytes_saved: u64,
    /// Pages sent as they are: the link is too fast for any saving to repay the codec.
    pub pages_raw_link_fast: u64,
    /// Pages sent as they are: they did not compress enough.
    pub pages_raw_aborted: u64,
    /// Segments whose library this machine saw move after a crash.
    pub takeovers: u64,
}

impl Counters {
    /// Every counter with its name as a daemon's metric.
    pub fn named(&self) -> [(&'static str, u64); 23] {
        [
            ("dsm_agent_faults", self.faults),
            ("dsm_agent_faults_local", self.faults_local),
            ("dsm_agent_requests", self.requests),
            ("dsm_agent_installs", self.installs),
            ("dsm_agent_upgrades", self.upgrades),
            ("dsm_agent_pages_sent", self.pages_sent),
            ("dsm_agent_zero_pages_sent", self.zero_pages_sent),
            ("dsm_agent_invalidated", self.invalidated),
            ("dsm_agent_frames_refused", self.frames_refused),
            ("dsm_agent_views_lost", self.views_lost),
            ("dsm_agent_lookups", self.lookups),
            ("dsm_agent_pages_lost", self.pages_lost),
            ("dsm_agent_restored", self.restored),
            ("dsm_agent_sites_down", self.sites_down),
            ("dsm_agent_lookups_refused", self.lookups_refused),
            ("dsm_agent_unlinked", self.unlinked),
            ("dsm_agent_feeds_ended", self.feeds_ended),
            ("dsm_agent_feeds_refused", self.feeds_refused),
            ("dsm_agent_pages_compressed", self.pages_compressed),
            ("dsm_agent_bytes_saved", self.bytes_saved),
            ("dsm_agent_pages_raw_link_fast", self.pages_raw_link_fast),
            ("dsm_agent_pages_raw_aborted", self.pages_raw_aborted),
            ("dsm_agent_takeovers", self.takeovers),
        ]
    }
}

/// A segment found by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Found {
    pub segment: SegmentId,
    pub meta: Meta,
    /// Its library site.
    pub library: SiteId,
}

/// A lookup's answer: found, or not, with the members that did not answer in time.
pub type LookupResult = Result<Found, Vec<SiteId>>;

struct Lookup {
    waiting: std::collections::BTreeSet<SiteId>,
    reply: mpsc::Sender<LookupResult>,
    deadline_us: u64,
}

/// Who a segment's library is, as [`Agent::add`] is told.
#[derive(Debug, Clone, Copy)]
pub enum Role<'a> {
    /// This machine created it and is its library; the sites admitted (`None`: every
    /// member).
    Library(Option<&'a [SiteId]>),
    /// Another machine is its library.
    Site(SiteId),
}

/// Why a segment could not be created, attached or mapped here.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("segment {0:#x} is already attached here")]
    Exists(SegmentId),
    #[error("segment {0:#x} is not attached here")]
    Unknown(SegmentId),
    #[error("a segment called {0:?} is attached here already")]
    NameTaken(String),
    #[error("a mapping of {got} pages of segment {segment:#x}, which has {want}")]
    Size {
        segment: SegmentId,
        got: u32,
        want: u32,
    },
    #[error("{0}")]
    Os(#[from] Errno),
}

struct Segment {
    name: String,
    meta: Meta,
    library_site: SiteId,
    copy: Copy,
    site: Site<()>,
    library: Option<Library>,
    views: Vec<View>,
}

/// A message on its way: for a site here (`to == me`) or the network.
struct Letter {
    segment: SegmentId,
    from: SiteId,
    to: SiteId,
    msg: Msg<()>,
    data: Data,
}

/// Sends a frame to a site.
pub type Net = Box<dyn FnMut(SiteId, Vec<u8>) + Send>;

/// One machine's agent.
pub struct Agent {
    me: SiteId,
    segments: HashMap<SegmentId, Segment>,
    names: HashMap<String, SegmentId>,
    lookups: HashMap<u64, Lookup>,
    next_view: u64,
    next_nonce: u64,
    letters: VecDeque<Letter>,
    /// Write copies sent away and kept until the library says the requester installed them
    /// (`Forget`) or crashed first (`Restore`): the site keeps the fact, this the bytes.
    ghosts: HashMap<(SegmentId, PageNo), Box<[u8]>>,
    /// Pages that arrived for a write and wait for the acknowledgements that every other copy
    /// is gone ([`Site::holds_arrived`]): the site keeps the fact, this the bytes.
    arrived: HashMap<(SegmentId, PageNo), Data>,
    /// When a page sent is compressed (`None`: never; zero pages are a flag regardless).
    compress: Option<Rule>,
    /// Segments whose library crashed, being taken over ([`takeover`]); reports in parts,
    /// and reports that came before this machine learnt of the crash.
    takeovers: HashMap<SegmentId, takeover::Takeover>,
    partials: HashMap<(SegmentId, SiteId), takeover::Partial>,
    early: takeover::Early,
    /// The last report this machine made of each segment (for a member that missed it).
    sent_reports: HashMap<SegmentId, netram_dsm::Report>,
    net: Net,
    epoch: Instant,
    pub counters: Counters,
}

impl Agent {
    /// The agent of site `me`, sending frames for other sites through `net`.
    pub fn new(me: SiteId, net: Net) -> Agent {
        Agent {
            me,
            segments: HashMap::new(),
            names: HashMap::new(),
            lookups: HashMap::new(),
            next_view: 0,
            // Nonces of another incarnation of this agent are not mistaken for this one's.
            next_nonce: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64),
            letters: VecDeque::new(),
            ghosts: HashMap::new(),
            arrived: HashMap::new(),
            compress: None,
            takeovers: HashMap::new(),
            partials: HashMap::new(),
            early: HashMap::new(),
            sent_reports: HashMap::new(),
            net,
            epoch: Instant::now(),
            counters: Counters::default(),
        }
    }

    /// Compresses the pages this machine sends when `rule` says it pays (MIRAGE+ §3.4;
    /// [`netram_proto::compress`]), or never (`None`, the default).
    pub fn set_compression(&mut self, rule: Option<Rule>) {
        self.compress = rule;
    }

    pub fn id(&self) -> SiteId {
        self.me
    }

    /// The agent's clock (µs), which its state machines are fed.
    fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    /// Adds segment `id`, called `name`, here: as its library (this machine created it and
    /// holds every page, zero, at first) or as a site of another machine's segment (holding
    /// none of its pages). Its memfd, for local processes.
    pub fn add(
        &mut self,
        id: SegmentId,
        name: &str,
        meta: Meta,
        role: Role<'_>,
    ) -> Result<&OwnedFd, AgentError> {
        if self.segments.contains_key(&id) {
            return Err(AgentError::Exists(id));
        }
        if self.names.contains_key(name) {
            return Err(AgentError::NameTaken(name.to_owned()));
        }
        let copy = Copy::new(name, meta.pages)?;
        let delta = (u64::from(meta.delta_ms) * 1000).max(MIN_HOLD_US);
        let (library_site, library) = match role {
            Role::Library(members) => (
                self.me,
                Some(match members {
                    Some(m) => Library::new(self.me, m.iter().copied()),
                    None => Library::open(self.me),
                }),
            ),
            Role::Site(l) => (l, None),
        };
        let seg = Segment {
            name: name.to_owned(),
            meta,
            library_site,
            copy,
            site: Site::new(self.me, library_site, library.is_some(), delta),
            library,
            views: Vec::new(),
        };
        self.names.insert(name.to_owned(), id);
        Ok(self.segments.entry(id).or_insert(seg).copy.fd())
    }

    /// Looks segment `name` up: here if it is attached here, else by asking every one of
    /// `members` (its library answers); the answer goes to `reply`, within `wait`.
    pub fn lookup(
        &mut self,
        name: &str,
        members: &[SiteId],
        wait: Duration,
        reply: mpsc::Sender<LookupResult>,
    ) {
        self.counters.lookups += 1;
        if let Some(seg) = self.names.get(name).and_then(|id| {
            self.segments.get(id).map(|s| Found {
                segment: *id,
                meta: s.meta,
                library: s.library_site,
            })
        }) {
            let _ = reply.send(Ok(seg));
            return;
        }
        let waiting: std::collections::BTreeSet<SiteId> =
            members.iter().copied().filter(|&m| m != self.me).collect();
        if waiting.is_empty() {
            let _ = reply.send(Err(Vec::new()));
            return;
        }
        self.next_nonce = self.next_nonce.wrapping_add(1);
        let nonce = self.next_nonce;
        let mut frame = Vec::new();
        wire::encode_naming(
            &Frame::Lookup {
                nonce,
                name: name.to_owned(),
            },
            &mut frame,
        );
        for &m in &waiting {
            (self.net)(m, frame.clone());
        }
        let deadline_us = self.now_us() + wait.as_micros() as u64;
        self.lookups.insert(
            nonce,
            Lookup {
                waiting,
                reply,
                deadline_us,
            },
        );
    }

    fn on_naming(&mut self, from: SiteId, frame: Frame) {
        match frame {
            Frame::Lookup { nonce, name } => {
                let seg = self.names.get(&name).and_then(|id| {
                    let s = &self.segments[id];
                    s.library.as_ref().map(|l| (*id, s.meta, l.admits(from)))
                });
                let answer = match seg {
                    Some((segment, meta, true)) => Frame::Found {
                        nonce,
                        segment,
                        meta,
                    },
                    Some((_, _, false)) => {
                        self.counters.lookups_refused += 1;
                        Frame::Absent { nonce }
                    }
                    None => Frame::Absent { nonce },
                };
                let mut out = Vec::new();
                wire::encode_naming(&answer, &mut out);
                (self.net)(from, out);
            }
            Frame::Found {
                nonce,
                segment,
                meta,
            } => {
                if self
                    .lookups
                    .get(&nonce)
                    .is_some_and(|l| l.waiting.contains(&from))
                {
                    let l = self.lookups.remove(&nonce).expect("present");
                    let _ = l.reply.send(Ok(Found {
                        segment,
                        meta,
                        library: from,
                    }));
                } else {
                    self.counters.frames_refused += 1;
                }
            }
            Frame::Absent { nonce } => {
                let expected = self
                    .lookups
                    .get_mut(&nonce)
                    .is_some_and(|l| l.waiting.remove(&from));
                if !expected {
                    self.counters.frames_refused += 1;
                } else if self.lookups[&nonce].waiting.is_empty() {
                    let l = self.lookups.remove(&nonce).expect("present");
                    let _ = l.reply.send(Err(Vec::new()));
                }
            }
            Frame::Unlink { segment } => {
                // From a member: the name goes here too (the processes attached keep it).
                if let Some(seg) = self.segments.get(&segment) {
                    if self.names.get(&seg.name) == Some(&segment) {
                        self.names.remove(&seg.name);
                        self.counters.unlinked += 1;
                    }
                }
            }
            Frame::Report {
                segment,
                era,
                part,
                last,
                attached,
                held,
            } => self.on_report(from, segment, era, part, last, attached, held),
            Frame::Protocol { .. } => unreachable!("naming frames only"),
        }
    }

    /// Takes segment `segment`'s name away, here and (told) on every one of `members`:
    /// nobody attaches it by name any more; the processes attached keep it. Whether the
    /// caller may is the daemon's to check first.
    pub fn unlink(&mut self, segment: SegmentId, members: &[SiteId]) {
        if let Some(seg) = self.segments.get(&segment) {
            if self.names.get(&seg.name) == Some(&segment) {
                self.names.remove(&seg.name);
                self.counters.unlinked += 1;
            }
        }
        let mut frame = Vec::new();
        wire::encode_naming(&Frame::Unlink { segment }, &mut frame);
        for &m in members.iter().filter(|&&m| m != self.me) {
            (self.net)(m, frame.clone());
        }
    }

    /// Segment `id`'s size and permissions, if it is attached here.
    pub fn meta(&self, id: SegmentId) -> Option<Meta> {
        self.segments.get(&id).map(|s| s.meta)
    }

    /// Segment `name`'s id here, if attached.
    pub fn segment_named(&self, name: &str) -> Option<(SegmentId, Meta)> {
        let id = *self.names.get(name)?;
        Some((id, self.segments[&id].meta))
    }

    /// Takes over a local process's mapping of segment `id` (registered with `view.uffd`,
    /// wholly write-protected): the pages this machine may write become writable in it.
    /// Returns the view's number, by which [`Agent::drop_view_by_number`] takes it away.
    pub fn add_view(&mut self, id: SegmentId, mut view: View) -> Result<u64, AgentError> {
        let seg = self.segments.get_mut(&id).ok_or(AgentError::Unknown(id))?;
        if view.pages != seg.copy.pages() {
            return Err(AgentError::Size {
                segment: id,
                got: view.pages,
                want: seg.copy.pages(),
            });
        }
        view.protect_all()?;
        for n in seg.site.writable() {
            view.unprotect(n)?;
        }
        self.next_view += 1;
        view.number = self.next_view;
        seg.views.push(view);
        Ok(self.next_view)
    }

    /// Drops view `number` of segment `id` (its process detached or exited). By number, not
    /// by process: a process that detaches and attaches again has an old view going while
    /// its new one is in use.
    pub fn drop_view_by_number(&mut self, id: SegmentId, number: u64) {
        if let Some(seg) = self.segments.get_mut(&id) {
            seg.views.retain(|v| v.number != number);
        }
    }

    /// Segment `id`'s copy here.
    pub fn copy(&self, id: SegmentId) -> Option<&Copy> {
        self.segments.get(&id).map(|s| &s.copy)
    }

    /// The library's and site's counters of segment `id`.
    pub fn protocol_counters(
        &self,
        id: SegmentId,
    ) -> Option<(
        netram_dsm::site::Counters,
        Option<netram_dsm::library::Counters>,
    )> {
        let s = self.segments.get(&id)?;
        Some((
            s.site.counters.clone(),
            s.library.as_ref().map(|l| l.counters.clone()),
        ))
    }

    /// A fault read from view `v` of segment `id`.
    pub fn on_fault(&mut self, id: SegmentId, v: usize, addr: usize, write: bool) {
        self.counters.faults += 1;
        let Some(seg) = self.segments.get_mut(&id) else {
            return;
        };
        let Some(page) = seg.views.get(v).and_then(|view| view.page_of(addr)) else {
            return;
        };
        let want = if write { Want::Write } else { Want::Read };
        // Where a fault's time goes, hop by hop (RUST_LOG=netram_shm::agent=trace; the
        // daemons of one machine share its clock, so their lines line up).
        tracing::trace!(page, write, "fault");
        match seg.site.fault(page, want) {
            Fault::Ready => {
                self.counters.faults_local += 1;
                // A hole here is a zero page this machine holds (the creator's, at first):
                // allocated, never overwritten. A stale protection (a view added while the
                // page was on its way) is lifted.
                let view = &seg.views[v];
                let ok = seg.copy.allocate(page).is_ok()
                    && if seg.site.access(page) == netram_dsm::Access::Write {
                        view.unprotect(page).is_ok()
                    } else {
                        view.wake(page).is_ok()
                    };
                if !ok {
                    self.drop_view(id, v);
                }
            }
            Fault::Lost => {
                let view = &seg.views[v];
                if view.poison(page).and_then(|()| view.wake(page)).is_err() {
                    self.drop_view(id, v);
                }
            }
            Fault::Wait => {}
            Fault::Ask(to, msg) => {
                self.counters.requests += 1;
                self.post(id, to, msg, None);
            }
        }
        self.pump();
    }

    /// A frame from site `from` (the transport vouches for who it is).
    pub fn on_frame(&mut self, from: SiteId, frame: &[u8]) {
        match wire::decode_frame(frame) {
            // A page past the segment's end is refused before the state machines see it: they
            // keep an entry per page named, and a peer could name billions.
            Ok(Frame::Protocol { segment, msg, data })
                if self
                    .segments
                    .get(&segment)
                    .is_some_and(|s| msg.page() < s.copy.pages()) =>
            {
                tracing::trace!(from, page = msg.page(), ?msg, "in");
                let letter = Letter {
                    segment,
                    from,
                    to: self.me,
                    msg,
                    data,
                };
                // Held back while the segment's next library is not known.
                if let Err(letter) = self.hold_back(letter) {
                    self.letters.push_back(letter);
                    self.pump();
                }
            }
            Ok(Frame::Protocol { .. }) | Err(_) => self.counters.frames_refused += 1,
            Ok(naming) => self.on_naming(from, naming),
        }
    }

    /// Carries out the orders whose windows have passed.
    pub fn tick(&mut self) {
        let now = self.now_us();
        let expired: Vec<u64> = self
            .lookups
            .iter()
            .filter(|(_, l)| l.deadline_us <= now)
            .map(|(&n, _)| n)
            .collect();
        for n in expired {
            let l = self.lookups.remove(&n).expect("listed");
            let _ = l.reply.send(Err(l.waiting.into_iter().collect()));
        }
        let ids: Vec<SegmentId> = self
            .segments
            .iter()
            .filter(|(_, s)| s.site.next_deadline().is_some_and(|d| d <= now))
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            let out = self.segments.get_mut(&id).expect("listed").site.tick(now);
            self.site_out(id, out);
            // A deferred `Restore` may have been carried out.
            self.reconcile(id);
        }
        self.tick_takeovers();
        self.pump();
    }

    /// How long until [`Agent::tick`] has something to do.
    pub fn next_deadline(&self) -> Option<Duration> {
        let now = self.now_us();
        self.segments
            .values()
            .filter_map(|s| s.site.next_deadline())
            .chain(self.lookups.values().map(|l| l.deadline_us))
            .chain(self.takeover_deadline())
            .min()
            .map(|d| Duration::from_micros(d.saturating_sub(now)))
    }

    fn post(&mut self, segment: SegmentId, to: SiteId, msg: Msg<()>, data: Data) {
        if to == self.me {
            self.letters.push_back(Letter {
                segment,
                from: self.me,
                to,
                msg,
                data,
            });
        } else {
            let mut frame = Vec::with_capacity(64 + data.as_ref().map_or(0, |d| d.len()));
            let packed = wire::encode(
                segment,
                &msg,
                data.as_deref(),
                self.compress.as_ref(),
                &mut frame,
            );
            match packed {
                Some(Packed::Compressed(n)) => {
                    self.counters.pages_compressed += 1;
                    self.counters.bytes_saved += (PAGE_SIZE - n) as u64;
                }
                Some(Packed::Raw(Skip::LinkFast)) => self.counters.pages_raw_link_fast += 1,
                Some(Packed::Raw(Skip::Aborted)) => self.counters.pages_raw_aborted += 1,
                Some(Packed::Zero) | None => {}
            }
            let t = tracing::enabled!(tracing::Level::TRACE).then(Instant::now);
            (self.net)(to, frame);
            if let Some(t) = t {
                let send_us = t.elapsed().as_micros() as u64;
                tracing::trace!(to, page = msg.page(), send_us, ?msg, "out");
            }
        }
    }

    /// Delivers the messages for this machine until none is left.
    fn pump(&mut self) {
        while let Some(l) = self.letters.pop_front() {
            debug_assert_eq!(l.to, self.me);
            let now = self.now_us();
            let Some(seg) = self.segments.get_mut(&l.segment) else {
                continue;
            };
            if l.msg.to_library() {
                match seg.library.as_mut() {
                    Some(lib) => {
                        for (to, msg) in lib.on_msg(l.from, l.msg) {
                            self.post(l.segment, to, msg, None);
                        }
                    }
                    None => self.counters.frames_refused += 1,
                }
                continue;
            }
            let page = l.msg.page();
            let mut is_page = matches!(l.msg, Msg::Page { .. });
            // A page that comes while another waits here is refused by the site: its bytes
            // must not take the waiting one's place.
            let held = seg.site.holds_arrived(page);
            let (out, woke) = seg.site.on_msg(l.from, l.msg, now);
            let mut data = l.data;
            if is_page && woke.is_none() && !held && seg.site.holds_arrived(page) {
                // Installed when the last acknowledgement comes.
                self.arrived.insert((l.segment, page), data.take());
            } else if woke == Some(page) && !is_page {
                // The last acknowledgement of a page that came before it.
                if let Some(d) = self.arrived.remove(&(l.segment, page)) {
                    (is_page, data) = (true, d);
                }
            }
            if woke == Some(page) && seg.site.is_lost(page) {
                // Its only copy went with a crashed machine: the processes that touch it are
                // told (SIGBUS at the page's address), never given zeros.
                tracing::error!(
                    segment = %seg.name,
                    page,
                    "a page of the segment was lost with a crashed machine: its accesses get SIGBUS"
                );
                self.counters.pages_lost += 1;
                let failed: Vec<usize> = seg
                    .views
                    .iter()
                    .enumerate()
                    .filter(|(_, v)| v.poison(page).and_then(|()| v.wake(page)).is_err())
                    .map(|(i, _)| i)
                    .collect();
                self.drop_views(l.segment, failed);
            } else if woke == Some(page) {
                // Installed: the contents first, then the access, then the waiting threads.
                let zero;
                let bytes: &[u8] = match &data {
                    Some(d) => d,
                    None => {
                        zero = [0u8; PAGE_SIZE];
                        &zero
                    }
                };
                let mut failed = Vec::new();
                if is_page {
                    if let Err(e) = seg.copy.write(page, bytes) {
                        tracing::error!("segment {:#x} page {page}: {e}", l.segment);
                    }
                    self.counters.installs += 1;
                } else {
                    self.counters.upgrades += 1;
                }
                let write = seg.site.access(page) == netram_dsm::Access::Write;
                for (i, v) in seg.views.iter().enumerate() {
                    let r = if write {
                        v.unprotect(page)
                    } else {
                        v.wake(page)
                    };
                    if r.is_err() {
                        failed.push(i);
                    }
                }
                seg.site.accessed(page);
                tracing::trace!(page, "woken");
                for i in failed.into_iter().rev() {
                    self.drop_view(l.segment, i);
                }
            }
            self.site_out(l.segment, out);
            self.reconcile(l.segment);
        }
    }

    /// Write copies kept after sending them away: written back and made writable for the pages
    /// the site took back (`Restore`), dropped for those it forgot (`Forget`). Only on the
    /// site's word: a forgotten copy while the site holds the page's write copy again looked
    /// like a restore, and the old contents put back undid later writes (stale reads in the
    /// five-host test).
    fn reconcile(&mut self, id: SegmentId) {
        let Some(seg) = self.segments.get_mut(&id) else {
            return;
        };
        for page in seg.site.take_restored() {
            let Some(bytes) = self.ghosts.remove(&(id, page)) else {
                continue;
            };
            if let Err(e) = seg.copy.write(page, &bytes) {
                tracing::error!("segment {} page {page}: {e}", seg.name);
            }
            self.counters.restored += 1;
            for v in &seg.views {
                let _ = v.unprotect(page);
            }
        }
        let seg = &self.segments[&id];
        self.ghosts
            .retain(|&(s, p), _| s != id || seg.site.has_ghost(p));
        // A page that will not be installed (lost, not taken after all, the library crashed).
        self.arrived
            .retain(|&(s, p), _| s != id || seg.site.holds_arrived(p));
    }

    /// Machine `node` crashed (the membership says so and it does not accept a connection):
    /// the libraries here drop its copies and requests and finish or undo what it was part
    /// of, and the segments whose library it was are taken over by the machines that have
    /// them ([`takeover`]), which report to each other and to the other `live` members.
    pub fn site_down(&mut self, node: SiteId, live: &[SiteId]) {
        if node == self.me {
            // This machine is not down while it runs this (a membership view that says so
            // is wrong about it): nothing to do.
            return;
        }
        self.counters.sites_down += 1;
        let ids: Vec<SegmentId> = self.segments.keys().copied().collect();
        for id in ids {
            let out = match self.segments.get_mut(&id).and_then(|s| s.library.as_mut()) {
                Some(lib) => lib.site_down::<()>(node),
                None => continue,
            };
            for (to, msg) in out {
                self.post(id, to, msg, None);
            }
        }
        self.library_down(node, live);
        self.pump();
    }

    /// Sends what a site produced, carrying out on the copy what its orders changed: a page
    /// sent is write-protected in every view before it is read, and punched out after if
    /// the receiver gets the write copy; an invalidated page is protected and punched out.
    fn site_out(&mut self, id: SegmentId, out: Vec<(SiteId, Msg<()>)>) {
        for (to, msg) in out {
            let seg = self
                .segments
                .get_mut(&id)
                .expect("segment of a site's output");
            let mut data = None;
            match msg {
                Msg::Page { page, grant, .. } => {
                    let failed = protect_everywhere(seg, page);
                    let mut buf = vec![0u8; PAGE_SIZE].into_boxed_slice();
                    if let Err(e) = seg.copy.read(page, &mut buf) {
                        tracing::error!("segment {id:#x} page {page}: {e}");
                    }
                    if grant == Want::Write {
                        // Kept until the library says the requester has it (or crashed).
                        self.ghosts.insert((id, page), buf.clone());
                        let _ = seg.copy.punch(page);
                    }
                    self.counters.pages_sent += 1;
                    if buf.iter().all(|&b| b == 0) {
                        self.counters.zero_pages_sent += 1;
                    } else {
                        data = Some(buf);
                    }
                    self.drop_views(id, failed);
                }
                Msg::Invalidated { page, .. } | Msg::Ack { page, .. } => {
                    // Only read copies are invalidated (the write copy is sent away), and
                    // they are protected already: this is the invariant's second line.
                    let failed = protect_everywhere(seg, page);
                    let _ = seg.copy.punch(page);
                    self.counters.invalidated += 1;
                    self.drop_views(id, failed);
                }
                _ => {}
            }
            self.post(id, to, msg, data);
        }
    }

    fn drop_views(&mut self, id: SegmentId, failed: Vec<usize>) {
        for i in failed.into_iter().rev() {
            self.drop_view(id, i);
        }
    }

    fn drop_view(&mut self, id: SegmentId, v: usize) {
        if let Some(seg) = self.segments.get_mut(&id) {
            if v < seg.views.len() {
                let view = seg.views.remove(v);
                tracing::debug!("segment {}: process {}'s view dropped", seg.name, view.pid);
                self.counters.views_lost += 1;
            }
        }
    }

    /// Every view's userfaultfd with its segment and index, to poll.
    fn views(&self) -> Vec<(SegmentId, usize)> {
        let mut v: Vec<(SegmentId, usize)> = self
            .segments
            .iter()
            .flat_map(|(&id, s)| (0..s.views.len()).map(move |i| (id, i)))
            .collect();
        v.sort_unstable();
        v
    }

    /// Reads and serves the faults waiting on view `v` of segment `id`.
    fn serve_view(&mut self, id: SegmentId, v: usize) {
        let mut events = Vec::new();
        let read = match self.segments.get(&id).and_then(|s| s.views.get(v)) {
            Some(view) => view.uffd.read_events(&mut events, 64),
            None => return,
        };
        if read.is_err() {
            self.drop_view(id, v);
            return;
        }
        for e in events {
            if let Event::Pagefault {
                addr, write, wp, ..
            } = e
            {
                self.on_fault(id, v, addr, write || wp);
            }
        }
    }
}

/// Write-protects `page` in every view of `seg`; the views whose process is gone.
fn protect_everywhere(seg: &Segment, page: PageNo) -> Vec<usize> {
    seg.views
        .iter()
        .enumerate()
        .filter(|(_, v)| v.protect(page).is_err())
        .map(|(i, _)| i)
        .collect()
}

/// A connection from another machine's daemon that the agent reads itself, in its own poll
/// loop: the receiving daemon's connection thread hands it over once it has carried DSM
/// messages, which saves a thread hand-off (a wake-up, ~60 µs here) on every message's path.
/// What it reads is hostile like any frame: [`Agent::on_frame`] checks it.
pub trait Feed: Send {
    /// The site whose messages arrive here, as the connection authenticated it.
    fn from(&self) -> SiteId;
    /// The descriptor to poll for input.
    fn fd(&self) -> rustix::fd::BorrowedFd<'_>;
    /// Reads what has arrived, without blocking, and hands each whole frame to `frame`
    /// (at most `budget` bytes, so that one busy peer does not starve the rest).
    /// `Ok(false)`: the connection ended, or broke the rules; it is dropped.
    fn read(&mut self, budget: usize, frame: &mut dyn FnMut(&[u8])) -> std::io::Result<bool>;
}

/// Connections read by the agent at most. A peer's connection ends when the peer drops it
/// (it opens a new one only after the old failed), so there is about one per peer.
pub const MAX_FEEDS: usize = 1024;
/// Bytes read from one connection per round of the loop.
const FEED_BUDGET: usize = 1 << 20;

/// What the agent's thread is handed.
enum Input {
    Frame(SiteId, Vec<u8>),
    Feed(Box<dyn Feed>),
    Call(Box<dyn FnOnce(&mut Agent) + Send>),
    Stop,
}

/// A running agent: its thread, and the way in.
pub struct Running {
    tx: mpsc::Sender<Input>,
    bell: Arc<OwnedFd>,
    thread: Option<std::thread::JoinHandle<Agent>>,
    counters: Arc<std::sync::Mutex<Counters>>,
}

/// Hands frames and calls to a running agent (clone it for each sender).
#[derive(Clone)]
pub struct Door {
    tx: mpsc::Sender<Input>,
    bell: Arc<OwnedFd>,
}

impl Door {
    fn send(&self, input: Input) -> bool {
        if self.tx.send(input).is_err() {
            return false;
        }
        let _ = rustix::io::write(&*self.bell, &1u64.to_ne_bytes());
        true
    }

    /// A frame that arrived from site `from`.
    pub fn deliver(&self, from: SiteId, frame: Vec<u8>) -> bool {
        self.send(Input::Frame(from, frame))
    }

    /// A connection for the agent to read itself ([`Feed`]): after the frames delivered
    /// before it, so their order holds.
    pub fn adopt(&self, feed: Box<dyn Feed>) -> bool {
        self.send(Input::Feed(feed))
    }

    /// Runs `f` on the agent's thread, not waiting for it (for a caller the agent may itself
    /// be waiting on, such as a link whose queue is full).
    pub fn post(&self, f: impl FnOnce(&mut Agent) + Send + 'static) -> bool {
        self.send(Input::Call(Box::new(f)))
    }

    /// Runs `f` on the agent's thread and returns its result (`None`: the agent stopped).
    pub fn call<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Agent) -> R + Send + 'static,
    ) -> Option<R> {
        let (tx, rx) = mpsc::channel();
        let sent = self.send(Input::Call(Box::new(move |a| {
            let _ = tx.send(f(a));
        })));
        if !sent {
            return None;
        }
        rx.recv().ok()
    }
}

impl Running {
    /// Starts `agent` on its own thread.
    pub fn start(agent: Agent) -> Result<Running, Errno> {
        use rustix::event::{eventfd, EventfdFlags};
        let bell = Arc::new(eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?);
        let (tx, rx) = mpsc::channel();
        let ring = bell.clone();
        let counters = Arc::new(std::sync::Mutex::new(agent.counters.clone()));
        let published = counters.clone();
        let thread = std::thread::Builder::new()
            .name(format!("netram-shm-{}", agent.id()))
            .spawn(move || run(agent, rx, ring, &published))
            .map_err(|_| Errno::AGAIN)?;
        Ok(Running {
            tx,
            bell,
            thread: Some(thread),
            counters,
        })
    }

    /// The agent's counters as of its last round (read without waiting for its thread).
    pub fn counters(&self) -> Counters {
        self.counters
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn door(&self) -> Door {
        Door {
            tx: self.tx.clone(),
            bell: self.bell.clone(),
        }
    }

    /// Stops the thread; the agent, with what it holds.
    pub fn stop(mut self) -> Agent {
        self.door().send(Input::Stop);
        self.thread
            .take()
            .expect("joined once")
            .join()
            .expect("the agent's thread panicked")
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = self.tx.send(Input::Stop);
            let _ = rustix::io::write(&*self.bell, &1u64.to_ne_bytes());
            let _ = t.join();
        }
    }
}

/// The agent's loop: its bell, every view's userfaultfd, the connections it reads, and the
/// windows' deadlines.
fn run(
    mut agent: Agent,
    rx: mpsc::Receiver<Input>,
    bell: Arc<OwnedFd>,
    published: &std::sync::Mutex<Counters>,
) -> Agent {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let mut feeds: Vec<Box<dyn Feed>> = Vec::new();
    loop {
        let views = agent.views();
        let ready: Vec<bool> = {
            let mut fds = Vec::with_capacity(1 + views.len() + feeds.len());
            fds.push(PollFd::new(&*bell, PollFlags::IN));
            for &(id, v) in &views {
                let uffd = &agent.segments[&id].views[v].uffd;
                fds.push(PollFd::new(uffd, PollFlags::IN));
            }
            for f in &feeds {
                fds.push(PollFd::from_borrowed_fd(f.fd(), PollFlags::IN));
            }
            let timeout = agent.next_deadline().map(|d| Timespec {
                tv_sec: d.as_secs() as i64,
                tv_nsec: i64::from(d.subsec_nanos()),
            });
            match poll(&mut fds, timeout.as_ref()) {
                Ok(_) | Err(Errno::INTR) => {}
                Err(e) => {
                    tracing::error!("the shared-memory agent's poll failed: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            fds.iter().map(|f| !f.revents().is_empty()).collect()
        };
        let (on_views, on_feeds) = ready[1..].split_at(views.len());
        // Connections first: they were polled in this round, before any added below.
        let mut ended = Vec::new();
        for (i, f) in feeds.iter_mut().enumerate() {
            if !on_feeds[i] {
                continue;
            }
            let from = f.from();
            match f.read(FEED_BUDGET, &mut |frame| agent.on_frame(from, frame)) {
                Ok(true) => {}
                Ok(false) => ended.push(i),
                Err(e) => {
                    tracing::debug!(from, "a shared-memory connection failed: {e}");
                    ended.push(i);
                }
            }
        }
        for i in ended.into_iter().rev() {
            feeds.swap_remove(i);
            agent.counters.feeds_ended += 1;
        }
        if ready[0] {
            let mut b = [0u8; 8];
            let _ = rustix::io::read(bell.as_fd(), &mut b);
            while let Ok(input) = rx.try_recv() {
                match input {
                    Input::Frame(from, frame) => agent.on_frame(from, &frame),
                    Input::Feed(f) => {
                        // The daemon keeps to the limit (it serves any more itself); this
                        // is the agent's own guard.
                        if feeds.len() >= MAX_FEEDS {
                            agent.counters.feeds_refused += 1;
                            continue;
                        }
                        // Read at once: whole frames may wait in its buffer already, which
                        // no poll would report.
                        let mut f = f;
                        let from = f.from();
                        match f.read(FEED_BUDGET, &mut |frame| agent.on_frame(from, frame)) {
                            Ok(true) => feeds.push(f),
                            Ok(false) | Err(_) => agent.counters.feeds_ended += 1,
                        }
                    }
                    Input::Call(f) => f(&mut agent),
                    Input::Stop => return agent,
                }
            }
        }
        // Views in reverse, so that one dropped does not shift those still to serve.
        for (i, &(id, v)) in views.iter().enumerate().rev() {
            if on_views[i] {
                agent.serve_view(id, v);
            }
        }
        agent.tick();
        if let Ok(mut p) = published.try_lock() {
            p.clone_from(&agent.counters);
        }
    }
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("me", &self.me)
            .field("segments", &self.segments.len())
            .field("counters", &self.counters)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Running").finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Door {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Door").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A write's page waits here for its acknowledgement; another page for the same page that
    /// comes meanwhile (a confused or hostile member's) is refused, and its bytes do not take
    /// the waiting page's place: what is installed after the last acknowledgement is what the
    /// clock site sent.
    #[test]
    fn a_page_waiting_for_acknowledgements_is_not_replaced() {
        const SEG: SegmentId = 0x33;
        let mut agent = Agent::new(1, Box::new(|_, _| {}));
        let meta = Meta {
            pages: 2,
            delta_ms: 0,
            uid: 0,
            mode: 0o600,
        };
        agent.add(SEG, "s", meta, Role::Site(2)).unwrap();
        let seg = agent.segments.get_mut(&SEG).unwrap();
        assert!(matches!(
            seg.site.fault(0, Want::Write),
            netram_dsm::Fault::Ask(2, _)
        ));
        let frame = |msg: Msg<()>, fill: u8| {
            let data = [fill; PAGE_SIZE];
            let mut f = Vec::new();
            wire::encode(SEG, &msg, Some(&data), None, &mut f);
            f
        };
        let page = |ticket, wait| Msg::Page {
            page: 0,
            grant: Want::Write,
            ticket,
            data: (),
            wait,
        };
        agent.on_frame(4, &frame(page(5, vec![3]), 0xaa));
        assert!(agent.segments[&SEG].site.holds_arrived(0));
        agent.on_frame(4, &frame(page(6, vec![]), 0xbb));
        assert_eq!(
            agent.segments[&SEG].site.access(0),
            netram_dsm::Access::None
        );
        let ack = Msg::Ack { page: 0, ticket: 5 };
        agent.on_frame(3, &frame(ack, 0));
        let seg = &agent.segments[&SEG];
        assert_eq!(seg.site.access(0), netram_dsm::Access::Write);
        let mut got = vec![0u8; PAGE_SIZE];
        seg.copy.read(0, &mut got).unwrap();
        assert!(
            got.iter().all(|&b| b == 0xaa),
            "the waiting page was replaced"
        );
    }
}
