//! The model check of the coherence protocol (issue 40): the library and site state machines,
//! exactly as the daemons will run them, composed over FIFO channels (one per direction and
//! pair, as TCP connections are), and every interleaving of three sites' faults, reads,
//! writes, message deliveries and passing windows explored by stateright. A page's contents
//! are the number of the write that made them.
//!
//! What must always hold: one writer or many readers; every copy a site may use holds the
//! latest write (so every read returns the last store in the one global order of writes:
//! MIRAGE+'s coherence, §2.1); no read ever saw anything else; when nothing is in flight the
//! library's directory is exactly who holds what; and no request is ever stuck (something can
//! always happen while a site waits). Checked with the window Δ at 0 and at 1 (orders that
//! arrive within it wait), for concurrent upgrades of one page (every site reads, then every
//! site writes), reads during invalidations, and writes racing reads.
//!
//! Crashes: a site other than the library's may crash (once per run, anywhere): it stops, the
//! messages it sent may still arrive, and at some later step the library is told
//! (`Library::site_down`). Then what must hold is about the live sites: one writer or many
//! readers among them, their copies agreeing, no live site reading a value older than one a
//! live site has seen (a write that only the crashed site ever saw may vanish with it: its
//! write copy is given back to the site that sent it, `Restore`), a page whose only copy
//! crashed is reported lost (`Lost`), never served stale, and no live site's request stuck.
//!
//! The library's own crash (its site, the creator, with it): every live site, at a step of its
//! own, stops taking the crashed library's orders and pages and reports what it holds
//! (`Site::library_down`); once all have, the lowest live site rebuilds the library from the
//! reports (`Library::rebuild`) and every site asks it from then on. The crashed library's
//! orders and the pages sent on them may still arrive, before and after a site reports. The
//! same properties must hold among the live sites, and the directory must be exact again once
//! the role has moved and nothing is in flight. The new library is made known to every site
//! in one step (the runtime announces it; a site that has not heard yet only waits).

use netram_dsm::{Access, Library, Msg, Report, Site, Want};
use stateright::{Checker, HasDiscoveries, Model, Property};
use std::collections::{BTreeMap, VecDeque};

const LIB: usize = usize::MAX;
/// The crashed library, as the sender of its messages still on their way.
const OLD_LIB: usize = usize::MAX - 1;
const PAGE: u32 = 0;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct World {
    lib: Library,
    sites: Vec<Site<u32>>,
    /// Each site's clock (ms): only passing windows move it.
    now: Vec<u64>,
    /// FIFO channels, (from, to) → messages (`LIB` for the library).
    net: BTreeMap<(usize, usize), VecDeque<Msg<u32>>>,
    /// The last write's number.
    latest: u32,
    writes: u32,
    /// The newest value each site has read or written: a live site may never read below what
    /// a live site has seen.
    seen: Vec<u32>,
    crashed: Vec<bool>,
    /// The library has been told of the crash.
    noticed: Vec<bool>,
    crashes: u32,
    /// The library's site.
    lib_site: u64,
    /// The library crashed and its role has not moved yet; the reports given so far.
    lib_down: bool,
    reports: BTreeMap<usize, Report>,
    takeovers: u32,
    /// Faults made (each becomes a request): bounds the exploration, since sites could take
    /// write access from each other forever without writing.
    faults: u32,
    stale_reads: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Action {
    Fault(usize, Want),
    Read(usize),
    Write(usize),
    Deliver(usize, usize),
    Elapse(usize),
    Crash(usize),
    Notice(usize),
    CrashLibrary,
    Report(usize),
    Takeover,
}

struct Dsm {
    sites: usize,
    delta_ms: u64,
    max_writes: u32,
    max_faults: u32,
    max_crashes: u32,
    /// The library's site may crash (once, anywhere).
    library_crash: bool,
    /// A broken site (the last): it acknowledges invalidations without dropping its copy.
    /// The checks must catch it, or they check nothing.
    liar: bool,
    /// Writes invalidating more copies than this have them acknowledged to the library
    /// (`Library::set_direct_acks`); else to their requester.
    direct_acks: usize,
}

impl World {
    fn send(&mut self, from: usize, out: Vec<(u64, Msg<u32>)>) {
        for (to, m) in out {
            let to = if m.to_library() { LIB } else { to as usize };
            if to == LIB && self.lib_down {
                // To the crashed library: lost.
                continue;
            }
            self.net.entry((from, to)).or_default().push_back(m);
        }
    }

    fn quiet(&self) -> bool {
        self.net.values().all(VecDeque::is_empty)
    }

    fn live(&self) -> impl Iterator<Item = &Site<u32>> {
        self.sites
            .iter()
            .enumerate()
            .filter(|(i, _)| !self.crashed[*i])
            .map(|(_, x)| x)
    }

    /// The newest value a live site has seen.
    fn seen_live(&self) -> u32 {
        (0..self.sites.len())
            .filter(|&i| !self.crashed[i])
            .map(|i| self.seen[i])
            .max()
            .unwrap_or(0)
    }
}

impl Model for Dsm {
    type State = World;
    type Action = Action;

    fn init_states(&self) -> Vec<World> {
        let ids = 0..self.sites as u64;
        let mut lib = Library::new(0, ids.clone());
        lib.set_direct_acks(self.direct_acks);
        vec![World {
            // Site 0 created the segment: it is the library site too.
            lib,
            sites: ids
                .map(|i| Site::new(i, 0, i == 0, self.delta_ms))
                .collect(),
            now: vec![0; self.sites],
            net: BTreeMap::new(),
            latest: 0,
            writes: 0,
            seen: vec![0; self.sites],
            crashed: vec![false; self.sites],
            noticed: vec![false; self.sites],
            crashes: 0,
            lib_site: 0,
            lib_down: false,
            reports: BTreeMap::new(),
            takeovers: 0,
            faults: 0,
            stale_reads: 0,
        }]
    }

    fn actions(&self, s: &World, actions: &mut Vec<Action>) {
        if self.library_crash && s.takeovers == 0 && !s.lib_down {
            actions.push(Action::CrashLibrary);
        }
        if s.lib_down {
            let live: Vec<usize> = (0..s.sites.len()).filter(|&i| !s.crashed[i]).collect();
            for &i in &live {
                if !s.reports.contains_key(&i) {
                    actions.push(Action::Report(i));
                }
            }
            if live.iter().all(|i| s.reports.contains_key(i)) {
                actions.push(Action::Takeover);
            }
        }
        for i in 1..s.sites.len() {
            if s.crashed[i] && !s.noticed[i] {
                actions.push(Action::Notice(i));
            }
            if !s.crashed[i] && s.crashes < self.max_crashes {
                actions.push(Action::Crash(i));
            }
        }
        for (i, site) in s.sites.iter().enumerate() {
            if s.crashed[i] {
                continue;
            }
            let access = site.access(PAGE);
            if site.asked(PAGE).is_none() && s.faults < self.max_faults {
                if access == Access::None {
                    actions.push(Action::Fault(i, Want::Read));
                }
                if access < Access::Write && s.writes < self.max_writes {
                    actions.push(Action::Fault(i, Want::Write));
                }
            }
            if access >= Access::Read {
                actions.push(Action::Read(i));
            }
            if access == Access::Write && s.writes < self.max_writes {
                actions.push(Action::Write(i));
            }
            if site.next_deadline().is_some_and(|t| t > s.now[i]) {
                actions.push(Action::Elapse(i));
            }
        }
        for (&(from, to), q) in &s.net {
            if !q.is_empty() {
                actions.push(Action::Deliver(from, to));
            }
        }
    }

    fn next_state(&self, s: &World, a: Action) -> Option<World> {
        let mut s = s.clone();
        match a {
            Action::Fault(i, want) => match s.sites[i].fault(PAGE, want) {
                netram_dsm::Fault::Ask(to, m) => {
                    s.faults += 1;
                    s.send(i, vec![(to, m)]);
                }
                _ => return None,
            },
            Action::Crash(i) => {
                s.crashed[i] = true;
                s.crashes += 1;
                // Nothing reaches it any more; what it sent may still arrive.
                s.net.retain(|&(_, to), _| to != i);
            }
            Action::Notice(i) => {
                s.noticed[i] = true;
                let out = s.lib.site_down(i as u64);
                s.send(LIB, out);
            }
            Action::CrashLibrary => {
                let l = s.lib_site as usize;
                s.crashed[l] = true;
                s.noticed[l] = true;
                s.lib_down = true;
                // Nothing reaches it (nor the library) any more; what it sent may arrive.
                s.net.retain(|&(_, to), _| to != l && to != LIB);
                let from_lib: Vec<_> = s
                    .net
                    .keys()
                    .filter(|&&(from, _)| from == LIB)
                    .copied()
                    .collect();
                for k in from_lib {
                    let q = s.net.remove(&k).expect("listed");
                    s.net.insert((OLD_LIB, k.1), q);
                }
            }
            Action::Report(i) => {
                let r = s.sites[i].library_down();
                s.reports.insert(i, r);
            }
            Action::Takeover => {
                let live: Vec<usize> = (0..s.sites.len()).filter(|&i| !s.crashed[i]).collect();
                let me = live[0] as u64;
                let reports: Vec<(u64, Report)> = std::mem::take(&mut s.reports)
                    .into_iter()
                    .map(|(i, r)| (i as u64, r))
                    .collect();
                let (lib, out) =
                    Library::rebuild::<u32>(me, &reports, live.iter().map(|&i| i as u64));
                let era = lib.era();
                s.lib = lib;
                s.lib_site = me;
                s.lib_down = false;
                s.takeovers += 1;
                for &i in &live {
                    s.sites[i].new_library(me, era);
                }
                s.send(LIB, out);
            }
            Action::Read(i) => {
                let now = s.now[i];
                let v = *s.sites[i].data(PAGE).expect("a copy to read");
                if v < s.seen_live() {
                    s.stale_reads += 1;
                }
                s.seen[i] = s.seen[i].max(v);
                s.sites[i].accessed(PAGE);
                let out = s.sites[i].tick(now);
                s.send(i, out);
            }
            Action::Write(i) => {
                let now = s.now[i];
                s.latest += 1;
                s.writes += 1;
                *s.sites[i].data(PAGE).expect("a copy to write") = s.latest;
                s.seen[i] = s.latest;
                s.sites[i].accessed(PAGE);
                let out = s.sites[i].tick(now);
                s.send(i, out);
            }
            Action::Deliver(from, to) => {
                let m = s.net.get_mut(&(from, to))?.pop_front()?;
                if s.net[&(from, to)].is_empty() {
                    s.net.remove(&(from, to));
                }
                let sender = match from {
                    LIB => s.lib_site,
                    OLD_LIB => 0,
                    _ => from as u64,
                };
                if self.liar && to == self.sites - 1 {
                    if let Msg::Invalidate {
                        page,
                        ticket,
                        ack_to,
                    } = m
                    {
                        let ack = match ack_to {
                            Some(r) => (r, Msg::Ack { page, ticket }),
                            None => (s.lib_site, Msg::Invalidated { page, ticket }),
                        };
                        s.send(to, vec![ack]);
                        return Some(s);
                    }
                }
                if to == LIB {
                    let out = s.lib.on_msg(sender, m);
                    s.send(LIB, out);
                } else if s.crashed[to] {
                    // Lost with it.
                } else {
                    let now = s.now[to];
                    let (out, _) = s.sites[to].on_msg(sender, m, now);
                    s.send(to, out);
                }
            }
            Action::Elapse(i) => {
                s.now[i] = s.sites[i].next_deadline()?;
                let now = s.now[i];
                let out = s.sites[i].tick(now);
                s.send(i, out);
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut p = vec![
            Property::always("one writer or many readers", |_, s: &World| {
                let w = s.live().filter(|x| x.access(PAGE) == Access::Write).count();
                let r = s.live().filter(|x| x.access(PAGE) == Access::Read).count();
                w == 0 || (w == 1 && r == 0)
            }),
            Property::always(
                "every usable copy holds the newest value a live site has seen",
                |_, s: &World| {
                    let newest = s.seen_live();
                    s.live().all(|x| {
                        let mut x = x.clone();
                        x.access(PAGE) == Access::None
                            || x.data(PAGE).copied().is_some_and(|v| v >= newest)
                    })
                },
            ),
            Property::always("every usable copy agrees", |_, s: &World| {
                let mut values = s.live().filter_map(|x| {
                    let mut x = x.clone();
                    (x.access(PAGE) != Access::None).then(|| *x.data(PAGE).expect("a copy"))
                });
                let first = values.next();
                values.all(|v| Some(v) == first)
            }),
            Property::always("no read returned an older write", |_, s: &World| {
                s.stale_reads == 0
            }),
            Property::always(
                "the directory is exact when nothing is in flight",
                |_, s: &World| {
                    let told = (0..s.sites.len()).all(|i| s.crashed[i] == s.noticed[i]);
                    // In flight includes an order waiting at a site (for a window, for its
                    // page's use): a request whose requester crashed is over at the library
                    // before its order is carried out.
                    let deferred = s.live().any(Site::has_deferred);
                    if !s.quiet() || s.lib.busy(PAGE) || !told || deferred || s.lib_down {
                        return true;
                    }
                    let (clock, mode, copies) = s.lib.holders(PAGE);
                    let holding: Vec<u64> = s
                        .live()
                        .filter(|x| x.access(PAGE) != Access::None)
                        .map(|x| x.id())
                        .collect();
                    if s.lib.lost(PAGE) {
                        return holding.is_empty() && copies.is_empty();
                    }
                    holding == copies
                        && s.sites[clock as usize].access(PAGE) == mode
                        && s.live().all(|x| x.access(PAGE) <= mode)
                },
            ),
            Property::always("no request is stuck", |_, s: &World| {
                let waiting = s.live().any(|x| x.asked(PAGE).is_some());
                // While a live site waits, a message is in flight, an order waits for a window
                // (or for its page's use), or the library is still to be told of a crash.
                let untold =
                    (0..s.sites.len()).any(|i| s.crashed[i] && !s.noticed[i]) || s.lib_down;
                !waiting || !s.quiet() || s.live().any(Site::has_deferred) || untold
            }),
            Property::sometimes(
                "every write made, the last read everywhere",
                |m: &Dsm, s: &World| {
                    s.writes == m.max_writes
                        && s.sites
                            .iter()
                            .filter(|x| x.access(PAGE) == Access::Read)
                            .count()
                            == m.sites
                },
            ),
        ];
        if self.library_crash {
            p.extend([
                Property::sometimes(
                    "the library's role moved, then a page written again",
                    |_, s: &World| {
                        s.takeovers > 0
                            && s.live()
                                .any(|x| x.access(PAGE) == Access::Write && x.counters.installs > 0)
                            && s.quiet()
                    },
                ),
                Property::sometimes("a page lost with the library", |_, s: &World| {
                    s.takeovers > 0 && s.live().any(|x| x.is_lost(PAGE))
                }),
                Property::sometimes(
                    "a write copy given back after the library crashed",
                    |_, s: &World| s.takeovers > 0 && s.live().any(|x| x.counters.restored > 0),
                ),
            ]);
        }
        if self.max_crashes == 0 {
            return p;
        }
        p.extend([
            Property::sometimes("a page lost with a crashed writer", |_, s: &World| {
                s.lib.lost(PAGE) && s.live().any(|x| x.is_lost(PAGE))
            }),
            Property::sometimes(
                "a write copy given back after its requester crashed",
                |_, s: &World| s.live().any(|x| x.counters.restored > 0),
            ),
            Property::sometimes(
                "a write's requester excused from a crashed reader's acknowledgement",
                |m: &Dsm, s: &World| m.direct_acks == 0 || s.lib.counters.excused > 0,
            ),
            Property::sometimes(
                "copies invalidated again after a write's requester crashed",
                |m: &Dsm, s: &World| m.direct_acks == 0 || s.lib.counters.reinvalidations > 0,
            ),
            Property::sometimes(
                "a read re-sent from another copy after its source crashed",
                |_, s: &World| s.lib.counters.probes > 0 && s.quiet() && !s.lib.busy(PAGE),
            ),
        ]);
        p
    }
}

fn model(sites: usize, delta_ms: u64, max_writes: u32, max_faults: u32) -> Dsm {
    Dsm {
        sites,
        delta_ms,
        max_writes,
        max_faults,
        max_crashes: 0,
        library_crash: false,
        liar: false,
        direct_acks: netram_dsm::library::MAX_WAIT,
    }
}

fn check(m: Dsm) -> usize {
    let checker = m
        .checker()
        .threads(2)
        // A broken protocol stops at its first counterexample; one whose states run away (a
        // bound lost) stops here rather than fill the machine's memory.
        .finish_when(HasDiscoveries::AnyFailures)
        .target_state_count(STATES_MAX)
        .spawn_bfs()
        .join();
    checker.assert_properties();
    let states = checker.unique_state_count();
    assert!(
        states < STATES_MAX,
        "{states} states: the exploration did not finish"
    );
    states
}

/// More states than the bounded model has (~450,000 at Δ = 0).
const STATES_MAX: usize = 5_000_000;

#[test]
fn three_sites_no_window() {
    let states = check(model(3, 0, 2, 5));
    eprintln!("three sites, Δ = 0: {states} states");
    assert!(states > 1_000, "{states} states: the model explores little");
}

#[test]
fn three_sites_with_a_window() {
    let states = check(model(3, 1, 2, 5));
    eprintln!("three sites, Δ = 1: {states} states");
    assert!(states > 1_000, "{states} states: the model explores little");
}

/// Invalidations acknowledged to the library (the path of writes with more copies to drop
/// than a frame names), a window of 1, a site crash.
#[test]
fn three_sites_acknowledgements_through_the_library() {
    let states = check(Dsm {
        direct_acks: 0,
        max_crashes: 1,
        ..model(3, 1, 2, 4)
    });
    eprintln!("three sites, acknowledged to the library: {states} states");
    assert!(states > 1_000, "{states} states: the model explores little");
}

/// A site crashes, anywhere in the run: faults, reads and writes of three sites around it.
#[test]
fn three_sites_one_crash() {
    let states = check(Dsm {
        max_crashes: 1,
        ..model(3, 0, 2, 4)
    });
    eprintln!("three sites, one crash: {states} states");
    assert!(states > 1_000, "{states} states: the model explores little");
}

/// The library's site crashes, anywhere in the run, and its role moves to the lowest live site,
/// rebuilt from the survivors' reports.
#[test]
fn three_sites_the_library_crashes() {
    let states = check(Dsm {
        library_crash: true,
        ..model(3, 0, 2, 4)
    });
    eprintln!("three sites, the library crashes: {states} states");
    assert!(states > 1_000, "{states} states: the model explores little");
}

/// The checks can fail: a site that says it dropped its copy and did not is caught (a reader
/// left beside a writer, and a read of an older write).
#[test]
fn a_site_that_keeps_an_invalidated_copy_is_caught() {
    let checker = Dsm {
        liar: true,
        ..model(3, 0, 2, 5)
    }
    .checker()
    .threads(2)
    .finish_when(HasDiscoveries::AllOf(
        [
            "one writer or many readers",
            "no read returned an older write",
        ]
        .into(),
    ))
    .target_state_count(STATES_MAX)
    .spawn_bfs()
    .join();
    for p in [
        "one writer or many readers",
        "no read returned an older write",
    ] {
        let path = checker
            .discovery(p)
            .unwrap_or_else(|| panic!("{p}: not caught"));
        eprintln!("{p}: caught in {} steps", path.into_actions().len());
    }
}
