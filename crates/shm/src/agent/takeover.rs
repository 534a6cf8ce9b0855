//! The agent's part when a segment's library crashes (issue 40; the protocol is
//! `netram_dsm`'s [`Site::library_down`] and [`Library::rebuild`], model-checked there).
//!
//! Every machine that has the segment stops taking the crashed library's orders and reports
//! what it holds to every live member (REPORT, in parts); a member that does not have the
//! segment answers that it does not, so that each knows when it has heard from everyone. Once
//! a machine has, it works out the next library as every other does — the lowest node among
//! those that reported having the segment and are alive — and that machine rebuilds the
//! directory from the reports; all then take their requests there (in the next era of
//! tickets). While a machine waits, the segment's protocol messages are held back and handed
//! to it afterwards (the new library's orders may come first), and the faults on it wait; then
//! every waiting thread is woken to fault again. MIRAGE+ has no such step; GMS §6 names the
//! need for its initiator (the remaining nodes elect a replacement) without building it. Here
//! the survivors' own state is the truth.
//!
//! What it takes on trust: that the members agree who is alive (each daemon declares a member
//! dead only on the membership's word and its own failed connection, `crates/server/src/shm.rs`).
//! A machine that never hears of the crash never reports, and the others wait for it.

use super::{Agent, Letter, SegmentId};
use crate::wire::{self, Frame};
use netram_dsm::{Held, Library, Report, SiteId};
use netram_proto::dsm::MAX_REPORT_HELD;
use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

/// Protocol messages held back for a segment whose library is being rebuilt, at most.
const HELD_BACK_MAX: usize = 1 << 16;
/// How often a report goes again to the members not heard from.
const RESEND: Duration = Duration::from_secs(2);

/// One segment's takeover in progress here.
pub(super) struct Takeover {
    /// The crashed library.
    dead: SiteId,
    /// Members not heard from in full yet.
    waiting: BTreeSet<SiteId>,
    /// Complete reports of the machines that have the segment (this one's first).
    reports: Vec<(SiteId, Report)>,
    /// Reporters that crashed since: their reports stand (what they installed tells which
    /// kept copies are old), and the new library takes them for crashed.
    died: BTreeSet<SiteId>,
    /// Protocol messages for the segment, held back until the next library is known.
    held_back: Vec<Letter>,
    sent_us: u64,
}

/// Parts of one member's report received so far.
pub(super) struct Partial {
    next: u32,
    era: u64,
    held: Vec<Held>,
}

/// Reports that arrived before this machine learnt of the crash itself.
pub(super) type Early = HashMap<SegmentId, HashMap<SiteId, (Report, bool)>>;

impl Agent {
    /// The segments whose library `dead` was: each begins its takeover, reporting to `live`.
    pub(super) fn library_down(&mut self, dead: SiteId, live: &[SiteId]) {
        let orphaned: Vec<SegmentId> = self
            .segments
            .iter()
            .filter(|(id, s)| {
                s.library.is_none() && s.library_site == dead && !self.takeovers.contains_key(id)
            })
            .map(|(&id, _)| id)
            .collect();
        for id in orphaned {
            let seg = self.segments.get_mut(&id).expect("listed");
            let report = seg.site.library_down();
            tracing::warn!(
                segment = %seg.name,
                library = dead,
                "a segment's library crashed: its survivors rebuild it"
            );
            let waiting: BTreeSet<SiteId> = live
                .iter()
                .copied()
                .filter(|&m| m != self.me && m != dead)
                .collect();
            // To every live member, those already heard from too (they wait for this one).
            let to: Vec<SiteId> = waiting.iter().copied().collect();
            self.send_report(id, &report, &to);
            self.sent_reports.insert(id, report.clone());
            let mut t = Takeover {
                dead,
                waiting,
                reports: vec![(self.me, report)],
                died: BTreeSet::new(),
                held_back: Vec::new(),
                sent_us: self.now_us(),
            };
            for (from, (r, attached)) in self.early.remove(&id).unwrap_or_default() {
                if t.waiting.remove(&from) && attached {
                    t.reports.push((from, r));
                }
            }
            self.takeovers.insert(id, t);
        }
        // Takeovers waiting for a member that crashed: not any more.
        for t in self.takeovers.values_mut() {
            t.waiting.remove(&dead);
            if t.reports.iter().any(|(s, _)| *s == dead) {
                t.died.insert(dead);
            }
        }
        self.finish_takeovers();
    }

    /// Sends `report` of segment `id` to `to`, in parts.
    fn send_report(&mut self, id: SegmentId, report: &Report, to: &[SiteId]) {
        let parts: Vec<&[Held]> = if report.pages.is_empty() {
            vec![&[]]
        } else {
            report.pages.chunks(MAX_REPORT_HELD).collect()
        };
        for (i, part) in parts.iter().enumerate() {
            let mut frame = Vec::new();
            wire::encode_naming(
                &Frame::Report {
                    segment: id,
                    era: report.era,
                    part: i as u32,
                    last: i + 1 == parts.len(),
                    attached: true,
                    held: part.to_vec(),
                },
                &mut frame,
            );
            for &m in to {
                (self.net)(m, frame.clone());
            }
        }
    }

    /// A part of a member's report.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn on_report(
        &mut self,
        from: SiteId,
        segment: SegmentId,
        era: u64,
        part: u32,
        last: bool,
        attached: bool,
        held: Vec<Held>,
    ) {
        let Some(seg) = self.segments.get(&segment) else {
            // Not here: say so once the sender has said all (so it is not waited for).
            if last && attached {
                let mut frame = Vec::new();
                wire::encode_naming(
                    &Frame::Report {
                        segment,
                        era: 0,
                        part: 0,
                        last: true,
                        attached: false,
                        held: Vec::new(),
                    },
                    &mut frame,
                );
                (self.net)(from, frame);
            }
            return;
        };
        let pages = seg.copy.pages();
        if held.iter().any(|h| h.page >= pages) {
            self.partials.remove(&(segment, from));
            self.counters.frames_refused += 1;
            return;
        }
        let p = self
            .partials
            .entry((segment, from))
            .or_insert_with(|| Partial {
                next: 0,
                era,
                held: Vec::new(),
            });
        if part == 0 {
            // A report sent again starts over.
            *p = Partial {
                next: 0,
                era,
                held: Vec::new(),
            };
        }
        if part != p.next || era != p.era || p.held.len() + held.len() > pages as usize {
            self.partials.remove(&(segment, from));
            self.counters.frames_refused += 1;
            return;
        }
        p.held.extend(held);
        p.next += 1;
        if !last {
            return;
        }
        let p = self.partials.remove(&(segment, from)).expect("present");
        let report = Report {
            era: p.era,
            pages: p.held,
        };
        match self.takeovers.get_mut(&segment) {
            Some(t) => {
                if t.waiting.remove(&from) {
                    if attached {
                        t.reports.push((from, report));
                    }
                } else {
                    self.counters.frames_refused += 1;
                }
            }
            // A member still in a takeover this machine has finished: it may not have had
            // this machine's report (lost with a link that gave up); it goes again.
            None if attached
                && self
                    .sent_reports
                    .get(&segment)
                    .is_some_and(|r| r.era == report.era) =>
            {
                let mine = self.sent_reports[&segment].clone();
                self.send_report(segment, &mine, &[from]);
            }
            None => {
                // Before this machine learnt of the crash itself (or a member's mistake:
                // used only if this machine finds its library dead too). One per member.
                let early = self.early.entry(segment).or_default();
                if early.len() < super::MAX_FEEDS || early.contains_key(&from) {
                    early.insert(from, (report, attached));
                } else {
                    self.counters.frames_refused += 1;
                }
            }
        }
        self.finish_takeovers();
    }

    /// Holds back a protocol message for a segment being taken over (or drops it, counted,
    /// past the bound); gives it back when the segment is not being taken over.
    pub(super) fn hold_back(&mut self, letter: Letter) -> Result<(), Letter> {
        match self.takeovers.get_mut(&letter.segment) {
            Some(t) if t.held_back.len() < HELD_BACK_MAX => {
                t.held_back.push(letter);
                Ok(())
            }
            Some(_) => {
                self.counters.frames_refused += 1;
                Ok(())
            }
            None => Err(letter),
        }
    }

    /// Sends the reports again to the members not heard from.
    pub(super) fn tick_takeovers(&mut self) {
        let now = self.now_us();
        let due: Vec<(SegmentId, Report, Vec<SiteId>)> = self
            .takeovers
            .iter_mut()
            .filter(|(_, t)| now.saturating_sub(t.sent_us) >= RESEND.as_micros() as u64)
            .map(|(&id, t)| {
                t.sent_us = now;
                (
                    id,
                    t.reports[0].1.clone(),
                    t.waiting.iter().copied().collect(),
                )
            })
            .collect();
        for (id, report, to) in due {
            self.send_report(id, &report, &to);
        }
    }

    /// When the next report is to go again.
    pub(super) fn takeover_deadline(&self) -> Option<u64> {
        self.takeovers
            .values()
            .map(|t| t.sent_us + RESEND.as_micros() as u64)
            .min()
    }

    /// Finishes every takeover that has heard from everyone.
    fn finish_takeovers(&mut self) {
        let ready: Vec<SegmentId> = self
            .takeovers
            .iter()
            .filter(|(_, t)| t.waiting.is_empty())
            .map(|(&id, _)| id)
            .collect();
        for id in ready {
            let t = self.takeovers.remove(&id).expect("listed");
            let alive: Vec<SiteId> = t
                .reports
                .iter()
                .map(|(s, _)| *s)
                .filter(|s| !t.died.contains(s))
                .collect();
            // This machine's own report is there, and it is alive (`site_down` is never about
            // it); the guard is against that changing.
            let Some(&next) = alive.iter().min() else {
                tracing::error!("segment {id:#x}: no live site reported; its library stays lost");
                continue;
            };
            let era = t.reports.iter().map(|(_, r)| r.era).max().unwrap_or(0) + 1;
            let mut out = Vec::new();
            let seg = self.segments.get_mut(&id).expect("a segment taken over");
            if next == self.me {
                let (mut lib, o) = Library::rebuild::<()>(self.me, &t.reports, alive.clone());
                out = o;
                for &d in &t.died {
                    out.extend(lib.site_down::<()>(d));
                }
                seg.library = Some(lib);
            }
            seg.library_site = next;
            seg.site.new_library(next, era);
            tracing::warn!(
                segment = %seg.name,
                crashed = t.dead,
                library = next,
                sites = alive.len(),
                "a segment's library moved"
            );
            self.counters.takeovers += 1;
            for (to, msg) in out {
                self.post(id, to, msg, None);
            }
            // Held back, in order; then every waiting thread faults again (asking the new
            // library).
            self.letters.extend(t.held_back);
            if let Some(seg) = self.segments.get(&id) {
                for v in &seg.views {
                    let _ = v.wake_all();
                }
            }
        }
        self.pump();
    }
}
