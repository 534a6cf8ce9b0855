//! Parity recovery (Nswap §IV-B3, paper 004): after a server is lost, the scan of every live
//! server for what it holds for the dead one, the groups rebuilt by XOR from their parity and
//! survivors, orphans protected again, damaged groups audited and dissolved, superseded copies
//! deleted again. Kept apart from the open groups and their replies (`mod.rs`): this half runs
//! only when something failed.
//!
//! A round of recovery never waits (issue 38: the maintenance thread held the region's lock
//! across every round trip of it, and faults waited behind it). It is a sequence of phases,
//! [`Round`]: each sends its requests and returns, and a later step, finding their answers in,
//! takes them and starts the next phase. Where a phase must see what the servers have after
//! what was sent before it (a scan), it waits for a [`Barrier`] to pass, not for everything in
//! flight: a busy program keeps sending.

use super::*;
use crate::requests::Barrier;

/// Answers in a row of a leaving holder's scan with nothing to move and signs of age, after
/// which the last one is believed (`Pager::par_release_holder`).
const LEAVING_RESCANS: u8 = 3;

/// Where a round of parity recovery is.
#[derive(Debug, Default)]
pub(crate) enum Round {
    /// Nothing out: the next step starts a round.
    #[default]
    Idle,
    /// The requests out when the round began must be answered first (deltas, write-backs,
    /// deletes: a scan must report what the holders have after them).
    Settling(Barrier),
    /// Superseded copies deleted again; their answers first, for the same reason.
    Deleting(Barrier),
    /// Pages stored outside any group (`batch`: page, version read) being read to join one again;
    /// `asked`: their (page, slot).
    Reprotecting {
        batch: Vec<(u64, u32)>,
        asked: BTreeSet<(u64, u32)>,
    },
    /// Every live server asked for its damaged groups: (server, request).
    Auditing { asked: Vec<(usize, u64)> },
    /// Every live server asked what it holds for recovering server `x`.
    Scanning { x: usize, asked: Vec<(usize, u64)> },
    /// The survivors of `x`'s groups being read: (holder, group, the survivors' slots).
    Reading {
        x: usize,
        planned: Vec<(usize, ScannedGroup, Vec<u32>)>,
    },
}

impl<T: Transport, D: Disk> Pager<T, D> {
    /// One step of recovery: takes in the answers of the round's phase under way and goes on
    /// with the next phases while their answers are in, a round at most. A round deletes
    /// superseded copies again, protects pages outside any group again, audits groups an
    /// overwrite may have damaged, scans every live server about the first recovering server
    /// and rebuilds the groups reported (as many as half the free slots allow); when the scans
    /// report nothing more, what is still missing there is lost.
    pub(crate) fn par_recover(&mut self, max: usize) -> Result<RecoveryStep, PagerError> {
        let mut step = RecoveryStep::default();
        self.poll()?;
        self.take_internal_reads();
        // Seven phases a round: the bound only guards against a phase that never stops.
        let mut rounds_ended = 0;
        for _ in 0..32 {
            let round = std::mem::take(&mut self.par_mut().round);
            let (next, go_on) = self.par_phase(round, max, &mut step)?;
            self.par_mut().round = next;
            if !go_on {
                // A round that ended with nothing in flight goes on to the next at once
                // (once): nothing would bring a waiting read's next step otherwise.
                rounds_ended += 1;
                let idle_round_end = matches!(self.par().round, Round::Idle) && self.idle();
                if !(idle_round_end && rounds_ended < 2 && self.par().pending() > 0) {
                    break;
                }
            }
        }
        self.pump_all();
        step.remaining = self.par().pending();
        Ok(step)
    }

    /// Runs one phase if its answers are in: the round after it, and whether to go on now.
    fn par_phase(
        &mut self,
        round: Round,
        max: usize,
        step: &mut RecoveryStep,
    ) -> Result<(Round, bool), PagerError> {
        Ok(match round {
            Round::Idle => (Round::Settling(self.barrier()), true),
            Round::Settling(mut b) => {
                if !self.passed(&mut b) {
                    return Ok((Round::Settling(b), false));
                }
                self.par_retry_stale();
                (Round::Deleting(self.barrier()), true)
            }
            Round::Deleting(mut b) => {
                if !self.passed(&mut b) {
                    return Ok((Round::Deleting(b), false));
                }
                self.par_reprotect_start(max)?
            }
            Round::Reprotecting { batch, asked } => {
                if !self.par_reads_in(&asked) {
                    return Ok((Round::Reprotecting { batch, asked }, false));
                }
                self.par_reprotect_finish(batch, &asked, step)?;
                self.par_audit_start()?
            }
            Round::Auditing { asked } => {
                if !self.par_scans_in(&asked) {
                    return Ok((Round::Auditing { asked }, false));
                }
                self.par_audit_finish(&asked, step);
                self.par_scan_start()?
            }
            Round::Scanning { x, asked } => {
                if !self.par_scans_in(&asked) {
                    return Ok((Round::Scanning { x, asked }, false));
                }
                self.par_scan_finish(x, &asked, step)?
            }
            Round::Reading { x, planned } => {
                let asked = planned_reads(&self.par().addrs[x], &planned);
                if !self.par_reads_in(&asked) {
                    return Ok((Round::Reading { x, planned }, false));
                }
                self.par_rebuild(x, planned, &asked, step)?;
                (Round::Idle, false)
            }
        })
    }

    /// Whether every read of `asked` (page, slot) is back, good (`read_in`) or failed
    /// (`read_failed`).
    fn par_reads_in(&self, asked: &BTreeSet<(u64, u32)>) -> bool {
        let back: BTreeSet<(u64, u32)> = self
            .par()
            .read_in
            .iter()
            .copied()
            .chain(self.par().read_failed.iter().map(|&(p, s, _)| (p, s)))
            .collect();
        asked.is_subset(&back)
    }

    /// Whether recovery's scan of `server` is out, unanswered.
    pub(super) fn par_scan_pending(&self, server: usize) -> bool {
        match &self.par().round {
            Round::Scanning { asked, .. } => asked
                .iter()
                .any(|&(s, id)| s == server && self.pending(s, id)),
            _ => false,
        }
    }

    /// Whether every scan of `asked` is answered, or its server failed.
    fn par_scans_in(&self, asked: &[(usize, u64)]) -> bool {
        asked
            .iter()
            .all(|&(s, id)| !self.server_states()[s].alive || !self.pending(s, id))
    }

    /// Sends a scan to every server of `to`; the scans sent, to find their answers by.
    fn par_send_scans(&mut self, to: &[usize], dead: SocketAddr, max: u32) -> Vec<(usize, u64)> {
        let mut asked = Vec::new();
        for &s in to {
            if let Some(id) = self.submit(s, Op::Scan, &Request::ParityScan { dead, max }) {
                asked.push((s, id));
            }
        }
        asked
    }

    /// Takes the answers to the scans of `asked`, in their order; whether every one of them
    /// answered (and its server is still alive).
    fn par_take_scans(&mut self, asked: &[(usize, u64)]) -> (Vec<Scanned>, bool) {
        let (mine, rest): (Vec<Scanned>, Vec<Scanned>) =
            std::mem::take(&mut self.par_mut().scanned)
                .into_iter()
                .partition(|a| asked.contains(&(a.server, a.id)));
        self.par_mut().scanned = rest;
        let answered =
            mine.len() == asked.len() && asked.iter().all(|&(s, _)| self.server_states()[s].alive);
        (mine, answered)
    }

    /// The scan of the first recovering server's groups; or, when none is left, the round's
    /// end: pages placed again since the last round wait in open groups and are shipped.
    fn par_scan_start(&mut self) -> Result<(Round, bool), PagerError> {
        let Some(&x) = self.par().recovering.first() else {
            self.par_seal(None)?;
            return Ok((Round::Idle, false));
        };
        let dead = self.par().addrs[x];
        self.par_mut().rejoined.clear();
        let budget = (self.free_slot_count() / 2).max(1);
        let per_scan = (budget / self.par().n.max(1)).clamp(1, netram_proto::MAX_BATCH);
        let to: Vec<usize> = (0..self.server_states().len())
            .filter(|&s| self.server_states()[s].alive && s != x)
            .collect();
        let asked = self.par_send_scans(&to, dead, per_scan as u32);
        Ok((Round::Scanning { x, asked }, true))
    }

    /// Takes the scans about `x`: orphans are protected again (or, superseded, deleted),
    /// groups damaged or past rebuilding are dissolved or dropped, and the survivors of the
    /// others are read (as many as half the free slots allow). When every scan answered with
    /// nothing, what the page table still had on `x` is lost and the round ends.
    fn par_scan_finish(
        &mut self,
        x: usize,
        asked: &[(usize, u64)],
        step: &mut RecoveryStep,
    ) -> Result<(Round, bool), PagerError> {
        let dead = self.par().addrs[x];
        let (scanned, answered) = self.par_take_scans(asked);
        if answered
            && scanned
                .iter()
                .all(|a| a.groups.is_empty() && a.orphans.is_empty())
        {
            self.par_finish_server(x, step);
            return Ok((Round::Idle, false));
        }
        // Orphans: pages whose parity the dead server held.
        let mut reprotect = Vec::new();
        for a in &scanned {
            for k in &a.orphans {
                if k.region != self.config().region || k.page >= self.config().pages {
                    continue;
                }
                let e = *self.table().get(k.page);
                if self.par().rejoined.contains(&k.page) {
                    // Protected again while the scans were out: the answer is older.
                } else if e.present && !e.lost && self.table().holders(k.page).contains(a.server) {
                    reprotect.push(k.page);
                } else if !self.writebacks().contains_key(&k.page) {
                    // A superseded copy left behind: delete it (its tag is gone, so the delete
                    // needs no holder).
                    self.counters_mut().deletes += 1;
                    self.delete(a.server, vec![*k]);
                }
            }
        }
        self.par_mut().unprotected.extend(reprotect);
        // Groups with a member on the dead server.
        let budget = (self.free_slot_count() / 2).max(1);
        let mut work: Vec<(usize, ScannedGroup)> = Vec::new();
        let mut reads = 0;
        for a in scanned {
            for g in a.groups {
                if reads + g.members.len() > budget && !work.is_empty() {
                    break;
                }
                reads += g.members.len();
                work.push((a.server, g));
            }
        }
        let mut planned = Vec::new();
        for (h, g) in work {
            if g.damaged {
                self.par_dissolve(h, &g, Some(dead), step);
                continue;
            }
            let index = |a: SocketAddr| self.par().addrs.iter().position(|&b| b == a);
            let lost = g.members.iter().filter(|m| m.server == dead).count();
            let survivors: Vec<(usize, Member)> = g
                .members
                .iter()
                .filter(|m| m.server != dead)
                .map(|m| (index(m.server).unwrap_or(usize::MAX), *m))
                .collect();
            let readable = survivors
                .iter()
                .all(|&(s, _)| s != usize::MAX && self.server_states()[s].alive);
            if lost != 1 || !readable {
                self.par_drop_group(h, &g, dead, step);
                continue;
            }
            let mut slots = Vec::with_capacity(survivors.len());
            for &(s, m) in &survivors {
                let slot = self.take_slot()?;
                slots.push(slot);
                // Queued, never waited for: a full window sends it as answers come in.
                self.queue_get(
                    s,
                    GetItem {
                        page: m.key.page,
                        slot,
                        pos: INTERNAL,
                        key: m.key,
                        version: m.version,
                        part: Part::Survivor,
                    },
                );
            }
            planned.push((h, g, slots));
        }
        self.pump_all();
        if planned.is_empty() {
            // Nothing to read: the orphans, drops and dissolutions go with the next round.
            self.par_seal(None)?;
            return Ok((Round::Idle, false));
        }
        Ok((Round::Reading { x, planned }, true))
    }

    /// Rebuilds the members on `x` of the groups whose survivors are read: the parity XORed
    /// with them gives the lost member, which leaves its group by a delta and, still wanted
    /// (its current version, with no holder), is written out again into a new group.
    fn par_rebuild(
        &mut self,
        x: usize,
        planned: Vec<(usize, ScannedGroup, Vec<u32>)>,
        asked: &BTreeSet<(u64, u32)>,
        step: &mut RecoveryStep,
    ) -> Result<(), PagerError> {
        let dead = self.par().addrs[x];
        // Matched by slot, not by page: one page can be a survivor of two groups at two
        // versions (a superseded copy not deleted yet), and the XOR of a page sealed at the
        // wrong version would still pass the CRC, which is linear.
        let fetched = self.par_take_read_in(asked);
        let failed: Vec<(u64, u32, bool)>;
        (failed, self.par_mut().read_failed) = std::mem::take(&mut self.par_mut().read_failed)
            .into_iter()
            .partition(|&(p, s, _)| asked.contains(&(p, s)));
        for (h, g, slots) in planned {
            let lost = *g.members.iter().find(|m| m.server == dead).expect("one");
            let survivors: Vec<(&Member, u32)> = g
                .members
                .iter()
                .filter(|m| m.server != dead)
                .zip(slots)
                .collect();
            let got = |m: &Member, slot: u32| fetched.contains(&(m.key.page, slot));
            if !survivors.iter().all(|&(m, slot)| got(m, slot)) {
                let transient = survivors
                    .iter()
                    .all(|&(m, slot)| got(m, slot) || failed.contains(&(m.key.page, slot, true)));
                if !transient {
                    self.par_drop_group(h, &g, dead, step);
                }
                continue;
            }
            let mut r = g.parity.clone();
            for &(m, slot) in &survivors {
                let p = Page::seal(m.key, m.version, self.slot(slot));
                r.xor(&Record::of(&p));
            }
            let page = r.as_record().page(lost.key);
            if !page.verify() || page.version != lost.version {
                // The parity does not rebuild it (damaged): the member leaves the group.
                self.par_drop_group(h, &g, dead, step);
                continue;
            }
            // Wanted back: it must be what its owner sealed (a survivor or the parity may lie in
            // a way the crc32c, which is linear, cannot see). If not, it is not rebuilt.
            let rebuilt = if self.par_wanted(lost.key.page, lost.version) {
                let slot = self.take_slot()?;
                self.slot_mut(slot).copy_from_slice(r.data.as_ref());
                if !self.unseal_slot(lost.key.page, lost.version, slot) {
                    self.release_slot(slot);
                    self.par_drop_group(h, &g, dead, step);
                    continue;
                }
                Some(slot)
            } else {
                None
            };
            self.counters_mut().parity_members_rebuilt += 1;
            let delta = Delta {
                owner: Owner::SELF,
                group: g.group,
                member: lost.server,
                key: lost.key,
                from: lost.version,
                to: lost.version,
                kind: DeltaKind::Remove,
                record: r.as_record(),
            };
            self.submit(h, Op::Delta, &Request::ParityDelta(vec![delta]));
            if let Some(slot) = rebuilt {
                self.par_forget_lost(x, lost.key.page);
                self.par_rewrite(lost.key.page, slot, true)?;
                step.started += 1;
            }
        }
        for (_, slot) in fetched {
            self.release_slot(slot);
        }
        // Rebuilt pages are protected at once, not left in open groups for later writes to
        // fill: ship the groups they joined, full or not (holders merge small ones).
        self.par_seal(None)?;
        self.pump_all();
        Ok(())
    }

    /// Degraded reads by ticket: recovery goes on a step (its answers taken in, its next
    /// requests sent: it never waits), and a read whose page came within reach (rebuilt and
    /// in write-back or stored, written, gone to the disk) or is lost starts again the
    /// ordinary way; the others wait on. Called by whoever takes finished reads, so that a
    /// fault on a lost page drives its recovery at the pace replies come in, not at the
    /// maintenance thread's. (Before, such a read ran recovery until its page was back, waiting
    /// for every reply under the region's lock.)
    pub(crate) fn par_serve_waiters(&mut self) -> Result<(), PagerError> {
        // (A step's reads take half the free slots at most: the rest stays for faults.)
        self.par_recover(usize::MAX)?;
        for it in std::mem::take(&mut self.par_mut().waiters) {
            if self.waits_for_recovery(&it) {
                self.par_mut().waiters.push(it);
            } else {
                self.restart_waiter(it);
            }
        }
        self.send_queued();
        Ok(())
    }

    /// Gives back the slots of recovery's reads that are in but not yet taken (a caller wants
    /// a slot and nothing else holds one); the phase that read them starts again at a later
    /// step. Whether any slot was freed.
    pub(crate) fn par_yield(&mut self) -> bool {
        let Some(par) = self.state_mut::<Par>() else {
            return false;
        };
        let asked = match &par.round {
            Round::Reprotecting { asked, .. } => asked.clone(),
            Round::Reading { x, planned } => planned_reads(&par.addrs[*x], planned),
            _ => return false,
        };
        if let Round::Reprotecting { batch, .. } = std::mem::take(&mut par.round) {
            par.unprotected.extend(batch.iter().map(|&(p, _)| p));
        }
        par.read_failed
            .retain(|&(p, s, _)| !asked.contains(&(p, s)));
        self.take_internal_reads();
        let before = self.free_slot_count();
        for (_, slot) in self.par_take_read_in(&asked) {
            self.release_slot(slot);
        }
        self.counters_mut().parity_recovery_yields += 1;
        self.free_slot_count() > before
    }

    /// A holder whose offer shrank below the parity pages it holds for us (Nswap §III): only
    /// it knows which groups those are, so it is asked (a scan naming [`SCAN_LEAVING`]).
    /// Never waits: the first call sends the scan and returns `None`; a later call (when
    /// nothing awaited is in flight, so the answer is in) takes the answer and returns up to
    /// `want` of its members that are their page's current copy and free to move: the
    /// migration writes each again as a new version that joins a new group where it is (its
    /// server tells the old holder to take it out, the old group protecting it until then,
    /// and an emptied group is freed there). Other members are superseded copies, which leave
    /// the group when they are deleted, or pages being written, whose write-back takes them
    /// out (or, written in place, a later scan names them again).
    ///
    /// The answer may be older than what it describes: a member written in place since
    /// (still in its group, at a newer version) or in write-back now is not moved; and the
    /// holder's count of what it wants moved may have changed since it answered (its offer
    /// moved, a group was shipped to it, pages left: an answer taken many steps later named
    /// none of the groups above an offer that had shrunk meanwhile). An answer with nothing
    /// to move and either sign of age is no proof that nothing of ours is left there: `None`,
    /// and the next call asks again (at most `LEAVING_RESCANS` times in a row; then
    /// `Some(empty)`, and the migration leaves the server until its count changes or the
    /// next probe). Until 2026-11-29 the scan waited for its answer with everything else in
    /// flight (`drain`).
    ///
    /// [`SCAN_LEAVING`]: netram_proto::SCAN_LEAVING
    pub(crate) fn par_release_holder(&mut self, h: usize, want: usize) -> Option<Vec<u64>> {
        let (id, rescans) = match self.par().leaving_scans.get(&h) {
            Some(&(Some(id), rescans)) => (id, rescans),
            asked => {
                let rescans = asked.map_or(0, |&(_, r)| r);
                let asked = self.par_send_scans(
                    &[h],
                    netram_proto::SCAN_LEAVING,
                    netram_proto::MAX_BATCH as u32,
                );
                // Not sent (its server is gone): nothing to move there for now.
                let &[(_, id)] = asked.as_slice() else {
                    self.par_mut().leaving_scans.remove(&h);
                    return Some(Vec::new());
                };
                self.par_mut().leaving_scans.insert(h, (Some(id), rescans));
                self.pump_all();
                return None;
            }
        };
        if self.pending(h, id) {
            return None;
        }
        self.par_mut().leaving_scans.remove(&h);
        let (scanned, answered) = self.par_take_scans(&[(h, id)]);
        if !answered {
            // Its server failed meanwhile: asked again once it is back and still leaving.
            return None;
        }
        let mut out = Vec::new();
        // What the holder has above its offer may have changed since it answered (its offer
        // moved, groups were shipped to it, pages left): its count moved meanwhile.
        let mut changed_since = scanned
            .iter()
            .any(|a| a.leaving_changes != self.server_states()[h].leaving_changes);
        for a in &scanned {
            self.counters_mut().parity_groups_leaving += a.groups.len() as u64;
            for m in a.groups.iter().flat_map(|g| &g.members) {
                let page = m.key.page;
                if m.key.region != self.config().region || page >= self.config().pages {
                    continue;
                }
                let e = *self.table().get(page);
                let at = self.par().addrs.iter().position(|&a| a == m.server);
                if !e.present
                    || e.lost
                    || !at.is_some_and(|s| self.table().holders(page).contains(s))
                {
                    continue;
                }
                if e.version == m.version && self.movable(page) {
                    if !out.contains(&page) {
                        out.push(page);
                    }
                } else {
                    changed_since = true;
                }
            }
        }
        if out.is_empty() && changed_since && rescans < LEAVING_RESCANS {
            self.par_mut().leaving_scans.insert(h, (None, rescans + 1));
            return None;
        }
        out.truncate(want);
        Some(out)
    }

    /// Forgets a leaving holder's scan and its answer: the server stopped leaving, or died.
    pub(crate) fn par_forget_leaving_scan(&mut self, h: usize) {
        if let Some((Some(id), _)) = self.par_mut().leaving_scans.remove(&h) {
            self.par_mut()
                .scanned
                .retain(|a| (a.server, a.id) != (h, id));
        }
    }

    /// Whether a rebuilt member is still the page's current version, wanted back.
    pub(super) fn par_wanted(&self, page: u64, version: u32) -> bool {
        if page >= self.config().pages || self.writebacks().contains_key(&page) {
            return false;
        }
        let e = self.table().get(page);
        e.present
            && !e.lost
            && !e.on_disk
            && e.version == version
            && self.alive_holder(page, None).is_none()
    }

    pub(super) fn par_forget_lost(&mut self, x: usize, page: u64) {
        if let Some(l) = self.par_mut().lost_on.get_mut(&x) {
            l.retain(|&(p, _)| p != page);
        }
    }

    /// Writes a page out again from `slot` at its current version: a rebuilt page, or one
    /// whose group is gone.
    pub(super) fn par_rewrite(
        &mut self,
        page: u64,
        slot: u32,
        rebuild: bool,
    ) -> Result<(), PagerError> {
        let e = *self.table().get(page);
        self.begin_writeback(
            page,
            Writeback {
                rebuild,
                join: true,
                ..Writeback::new(slot, e.version)
            },
        );
        self.par_place(page)
    }

    /// A group that cannot rebuild its member on the dead server (more of it is gone than one
    /// parity page covers, or a survivor no longer matches): the member is dropped from it and,
    /// if still wanted, lost; the other members are protected again elsewhere.
    pub(super) fn par_drop_group(
        &mut self,
        h: usize,
        g: &ScannedGroup,
        dead: SocketAddr,
        step: &mut RecoveryStep,
    ) {
        let zero = OwnedRecord::default();
        let mut drops = Vec::new();
        for m in g.members.iter().filter(|m| m.server == dead) {
            drops.push(drop_delta(g.group, m, &zero));
            if self.par_wanted(m.key.page, m.version) {
                self.table_mut().get_mut(m.key.page).lost = true;
                self.counters_mut().pages_unrecoverable += 1;
                step.unrecoverable += 1;
            }
        }
        if !drops.is_empty() {
            self.submit(h, Op::Delta, &Request::ParityDelta(drops));
        }
        let others: Vec<u64> = g
            .members
            .iter()
            .filter(|m| m.server != dead && m.key.page < self.config().pages)
            .map(|m| m.key.page)
            .collect();
        self.par_mut().unprotected.extend(others);
    }

    /// A damaged group (its parity covers a version some member's server does not have): every
    /// member is dropped from it, so that its holder frees it, and the members still wanted
    /// join new groups where they are; one on the dead server, if still wanted, is lost.
    pub(super) fn par_dissolve(
        &mut self,
        h: usize,
        g: &ScannedGroup,
        dead: Option<SocketAddr>,
        step: &mut RecoveryStep,
    ) {
        self.counters_mut().parity_groups_dissolved += 1;
        let zero = OwnedRecord::default();
        let drops = g
            .members
            .iter()
            .map(|m| drop_delta(g.group, m, &zero))
            .collect();
        self.submit(h, Op::Delta, &Request::ParityDelta(drops));
        for m in &g.members {
            if m.key.region != self.config().region || m.key.page >= self.config().pages {
                continue;
            }
            if Some(m.server) == dead {
                if self.par_wanted(m.key.page, m.version) {
                    self.table_mut().get_mut(m.key.page).lost = true;
                    self.counters_mut().pages_unrecoverable += 1;
                    step.unrecoverable += 1;
                }
            } else {
                self.par_mut().unprotected.insert(m.key.page);
            }
        }
    }

    /// Audits the groups that overwrites sent elsewhere may have damaged (see
    /// [`Par::suspects`]), once the page's copy on that server has been deleted: the holder
    /// then finds the delete stale, marks the group damaged and reports it to a scan that
    /// names no dead server. Until the audit, the group's other members have no working
    /// parity. With no such suspect, the recovery scan is next.
    fn par_audit_start(&mut self) -> Result<(Round, bool), PagerError> {
        if !self
            .par()
            .suspects
            .iter()
            .any(|&(page, s)| self.par_suspect_settled(page, s))
        {
            return self.par_scan_start();
        }
        self.counters_mut().parity_audits += 1;
        let to: Vec<usize> = (0..self.server_states().len())
            .filter(|&s| self.server_states()[s].alive)
            .collect();
        // No server listens on port 0: only damaged groups are reported.
        let nobody = SocketAddr::from(([0, 0, 0, 0], 0));
        let asked = self.par_send_scans(&to, nobody, netram_proto::MAX_BATCH as u32);
        Ok((Round::Auditing { asked }, true))
    }

    fn par_suspect_settled(&self, page: u64, s: usize) -> bool {
        !self.writebacks().contains_key(&page) && !self.par().stale.contains(&(s, self.key(page)))
    }

    /// Dissolves the damaged groups the audit's scans report; when every server answered and
    /// none was, the suspects settled before it are cleared.
    fn par_audit_finish(&mut self, asked: &[(usize, u64)], step: &mut RecoveryStep) {
        let (scanned, answered) = self.par_take_scans(asked);
        let mut found = false;
        for a in scanned {
            for g in a.groups.iter().filter(|g| g.damaged) {
                found = true;
                self.par_dissolve(a.server, g, None, step);
            }
        }
        if answered && !found {
            // (A suspect that settled while the scans were out is audited again next round.)
            let suspects = std::mem::take(&mut self.par_mut().suspects);
            let left = suspects
                .into_iter()
                .filter(|&(page, s)| !self.par_suspect_settled(page, s))
                .collect();
            self.par_mut().suspects = left;
        }
        self.pump_all();
    }

    /// The scans report nothing more about `x`: what the page table still had there and nobody
    /// rebuilt is lost.
    pub(super) fn par_finish_server(&mut self, x: usize, step: &mut RecoveryStep) {
        let par = self.par_mut();
        par.recovering.remove(&x);
        if par.recovering.is_empty() {
            par.missing_tries.clear();
        }
        let lost = par.lost_on.remove(&x).unwrap_or_default();
        for (page, version) in lost {
            if self.par_wanted(page, version) {
                self.table_mut().get_mut(page).lost = true;
                self.counters_mut().pages_unrecoverable += 1;
                step.unrecoverable += 1;
            }
        }
    }

    /// Pages stored outside any group join one again, where they are: their reads go out
    /// (as many as half the free slots allow, `max` at most). With none, the audit is next.
    fn par_reprotect_start(&mut self, max: usize) -> Result<(Round, bool), PagerError> {
        let budget = (self.free_slot_count() / 2).min(max);
        let mut batch = Vec::new();
        while batch.len() < budget {
            let Some(page) = self.par_mut().unprotected.pop_first() else {
                break;
            };
            let e = *self.table().get(page);
            if !e.present || e.lost || self.writebacks().contains_key(&page) {
                continue;
            }
            let Some(s) = self.alive_holder(page, None) else {
                continue;
            };
            batch.push((page, s));
        }
        if batch.is_empty() {
            return self.par_audit_start();
        }
        let mut asked = BTreeSet::new();
        let mut read = Vec::with_capacity(batch.len());
        for (page, s) in batch {
            read.push((page, self.table().get(page).version));
            let slot = self.take_slot()?;
            asked.insert((page, slot));
            let it = self.page_get_item(page, slot, INTERNAL);
            self.queue_get(
                s,
                GetItem {
                    part: Part::Survivor,
                    ..it
                },
            );
        }
        self.pump_all();
        Ok((Round::Reprotecting { batch: read, asked }, true))
    }

    /// The pages read back are written out again into new groups (unless written, discarded
    /// or lost meanwhile); those whose read failed wait for a later round.
    fn par_reprotect_finish(
        &mut self,
        batch: Vec<(u64, u32)>,
        asked: &BTreeSet<(u64, u32)>,
        step: &mut RecoveryStep,
    ) -> Result<(), PagerError> {
        let read_at: HashMap<u64, u32> = batch.iter().copied().collect();
        self.par_mut()
            .read_failed
            .retain(|&(p, s, _)| !asked.contains(&(p, s)));
        for (page, slot) in self.par_take_read_in(asked) {
            let e = *self.table().get(page);
            if !e.present
                || e.lost
                || self.writebacks().contains_key(&page)
                || read_at.get(&page) != Some(&e.version)
            {
                // Written (its write-back places it in a group), discarded or lost since
                // its read went out.
                self.release_slot(slot);
                continue;
            }
            if !self.unseal_slot(page, e.version, slot) {
                // Read back raw, and not what this pager sealed: tried again later.
                self.release_slot(slot);
                continue;
            }
            self.counters_mut().parity_reprotected += 1;
            step.started += 1;
            self.par_rewrite(page, slot, false)?;
        }
        for (page, version) in batch {
            let e = *self.table().get(page);
            if !self.writebacks().contains_key(&page)
                && e.present
                && !e.lost
                && e.version == version
            {
                // Its read failed on the way: try again later.
                self.par_mut().unprotected.insert(page);
            }
        }
        self.par_seal(None)?;
        self.pump_all();
        Ok(())
    }

    /// Takes the survivor reads of `asked` that are in.
    fn par_take_read_in(&mut self, asked: &BTreeSet<(u64, u32)>) -> BTreeSet<(u64, u32)> {
        let par = self.par_mut();
        let mine: Vec<(u64, u32)>;
        (mine, par.read_in) = std::mem::take(&mut par.read_in)
            .into_iter()
            .partition(|f| asked.contains(f));
        mine.into_iter().collect()
    }

    /// Completes everything in flight and collects the pager's own finished reads into
    /// `fetched`, leaving a caller's reads where they are.
    pub(super) fn par_drain(&mut self) -> Result<(), PagerError> {
        loop {
            self.drain()?;
            self.resubmit_retries();
            if self.idle() {
                break;
            }
        }
        self.take_internal_reads();
        Ok(())
    }

    /// Deletes superseded copies again (their holder may answer now, or be known dead and
    /// forgotten by the server); gives up on one after `STALE_TRIES` rounds (it stays until
    /// the session ends).
    pub(super) fn par_retry_stale(&mut self) {
        let stale = std::mem::take(&mut self.par_mut().stale);
        for (s, k) in stale {
            // Deletes go by key: a copy of the current version there must not be deleted in
            // its place, and one may be on its way.
            if k.page < self.config().pages && self.writebacks().contains_key(&k.page) {
                self.par_mut().stale.push((s, k));
                continue;
            }
            let current = k.page < self.config().pages
                && self.table().holders(k.page).contains(s)
                && !self.table().get(k.page).lost;
            if current || !self.server_states()[s].alive {
                self.par_mut().stale_tries.remove(&(s, k));
                continue;
            }
            let tries = self.par_mut().stale_tries.entry((s, k)).or_insert(0);
            *tries += 1;
            if *tries > STALE_TRIES {
                self.par_mut().stale_tries.remove(&(s, k));
                tracing::warn!(server = s, key = ?k, "giving up deleting a superseded copy");
                continue;
            }
            // Its answer puts it back on the list if the server kept it again.
            self.counters_mut().deletes += 1;
            self.delete(s, vec![k]);
        }
    }
}

/// The owner's own delta taking member `m` out of `group` (its holder forgets it; `zero`: no
/// data changes).
fn drop_delta<'a>(group: u64, m: &Member, zero: &'a OwnedRecord) -> Delta<'a> {
    Delta {
        owner: Owner::SELF,
        group,
        member: m.server,
        key: m.key,
        from: m.version,
        to: m.version,
        kind: DeltaKind::Drop,
        record: zero.as_record(),
    }
}

/// The (page, slot) of the survivor reads of `planned` (members not on `dead`).
fn planned_reads(
    dead: &SocketAddr,
    planned: &[(usize, ScannedGroup, Vec<u32>)],
) -> BTreeSet<(u64, u32)> {
    planned
        .iter()
        .flat_map(|(_, g, slots)| {
            let survivors = g.members.iter().filter(move |m| m.server != *dead);
            survivors.zip(slots).map(|(m, &slot)| (m.key.page, slot))
        })
        .collect()
}
