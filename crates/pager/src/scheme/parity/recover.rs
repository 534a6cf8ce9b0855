//! Parity recovery (Nswap §IV-B3, paper 004): after a server is lost, the scan of every live
//! server for what it holds for the dead one, the groups rebuilt by XOR from their parity and
//! survivors, orphans protected again, damaged groups audited and dissolved, superseded copies
//! deleted again. Kept apart from the open groups and their replies (`mod.rs`): this half runs
//! only when something failed, and is the half that waits for its own reads.

use super::*;

impl<T: Transport, D: Disk> Pager<T, D> {
    /// One round of recovery: scans every live server about the first recovering server,
    /// rebuilds the groups reported (as many as the free slots allow) and protects the orphans
    /// again; when the scans report nothing more, what is still missing is lost.
    pub(crate) fn par_recover(&mut self, max: usize) -> Result<RecoveryStep, PagerError> {
        let mut step = RecoveryStep::default();
        // Deltas and write-backs in flight must have settled: a scan reports what holders have.
        self.drain()?;
        self.par_retry_stale();
        self.drain()?;
        self.par_reprotect(max, &mut step)?;
        self.par_audit(&mut step)?;
        let Some(&x) = self.par().recovering.first() else {
            // Pages placed again since the last round wait in open groups: ship them.
            self.par_seal(None)?;
            self.pump_all();
            step.remaining = self.par().pending();
            return Ok(step);
        };
        let dead = self.par().addrs[x];
        self.par_mut().rejoined.clear();
        let budget = (self.free_slots.len() / 2).max(1);
        let per_scan = (budget / self.par().n.max(1)).clamp(1, netram_proto::MAX_BATCH);
        let asked: Vec<usize> = (0..self.servers.len())
            .filter(|&s| self.servers[s].alive && s != x)
            .collect();
        for &s in &asked {
            self.submit(
                s,
                Op::Scan,
                &Request::ParityScan {
                    dead,
                    max: per_scan as u32,
                },
            );
        }
        self.drain()?;
        let scanned = std::mem::take(&mut self.par_mut().scanned);
        let answered = scanned.len() == asked.len() && asked.iter().all(|s| self.servers[*s].alive);
        if answered && scanned.iter().all(|(_, g, o)| g.is_empty() && o.is_empty()) {
            self.par_finish_server(x, &mut step);
            step.remaining = self.par().pending();
            return Ok(step);
        }
        // Orphans: pages whose parity the dead server held.
        let mut reprotect = Vec::new();
        for (s, _, orphans) in &scanned {
            for k in orphans {
                if k.region != self.cfg.region || k.page >= self.cfg.pages {
                    continue;
                }
                let e = *self.table.get(k.page);
                if self.par().rejoined.contains(&k.page) {
                    // Protected again while the scans were out: the answer is older.
                } else if e.present && !e.lost && self.table.holders(k.page).contains(*s) {
                    reprotect.push(k.page);
                } else if !self.writeback.contains_key(&k.page) {
                    // A superseded copy left behind: delete it (its tag is gone, so the delete
                    // needs no holder).
                    self.counters.deletes += 1;
                    self.delete(*s, vec![*k]);
                }
            }
        }
        self.par_mut().unprotected.extend(reprotect);
        // Groups with a member on the dead server.
        let mut work: Vec<(usize, ScannedGroup)> = Vec::new();
        let mut reads = 0;
        for (s, groups, _) in scanned {
            for g in groups {
                if reads + g.members.len() > budget && !work.is_empty() {
                    break;
                }
                reads += g.members.len();
                work.push((s, g));
            }
        }
        let mut planned = Vec::new();
        for (h, g) in work {
            if g.damaged {
                self.par_dissolve(h, &g, Some(dead), &mut step);
                continue;
            }
            let index = |a: SocketAddr| self.par().addrs.iter().position(|&b| b == a);
            let lost: Vec<&Member> = g.members.iter().filter(|m| m.server == dead).collect();
            let survivors: Vec<(usize, Member)> = g
                .members
                .iter()
                .filter(|m| m.server != dead)
                .map(|m| (index(m.server).unwrap_or(usize::MAX), *m))
                .collect();
            let readable = survivors
                .iter()
                .all(|&(s, _)| s != usize::MAX && self.servers[s].alive);
            if lost.len() != 1 || !readable {
                self.par_drop_group(h, &g, dead, &mut step);
                continue;
            }
            let mut slots = Vec::with_capacity(survivors.len());
            for &(s, m) in &survivors {
                let slot = self.take_slot()?;
                slots.push(slot);
                self.submit_get_item(
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
        self.par_drain()?;
        // Matched by slot, not by page: one page can be a survivor of two groups at two
        // versions (a superseded copy not deleted yet), and the XOR of a page sealed at the
        // wrong version would still pass the CRC, which is linear.
        // (Other reads of the pager's own, a move's, stay for their step.)
        let asked: BTreeSet<(u64, u32)> = planned
            .iter()
            .flat_map(|(_, g, slots)| {
                let survivors = g.members.iter().filter(|m| m.server != dead);
                survivors.zip(slots).map(|(m, &slot)| (m.key.page, slot))
            })
            .collect();
        let fetched: Vec<(u64, u32)>;
        (fetched, self.fetched) = std::mem::take(&mut self.fetched)
            .into_iter()
            .partition(|f| asked.contains(f));
        let fetched: BTreeSet<(u64, u32)> = fetched.into_iter().collect();
        let failed = std::mem::take(&mut self.par_mut().read_failed);
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
                    self.par_drop_group(h, &g, dead, &mut step);
                }
                continue;
            }
            let mut r = g.parity.clone();
            for &(m, slot) in &survivors {
                let at = slot as usize * PAGE_SIZE;
                let p = Page::seal(m.key, m.version, &self.slots[at..at + PAGE_SIZE]);
                r.xor(&Record::of(&p));
            }
            let page = r.as_record().page(lost.key);
            if !page.verify() || page.version != lost.version {
                // The parity does not rebuild it (damaged): the member leaves the group.
                self.par_drop_group(h, &g, dead, &mut step);
                continue;
            }
            // Wanted back: it must be what its owner sealed (a survivor or the parity may lie in
            // a way the crc32c, which is linear, cannot see). If not, it is not rebuilt.
            let rebuilt = if self.par_wanted(lost.key.page, lost.version) {
                let slot = self.take_slot()?;
                let at = slot as usize * PAGE_SIZE;
                self.slots[at..at + PAGE_SIZE].copy_from_slice(r.data.as_ref());
                if !self.unseal_slot(lost.key.page, lost.version, slot) {
                    self.release_slot(slot);
                    self.par_drop_group(h, &g, dead, &mut step);
                    continue;
                }
                Some(slot)
            } else {
                None
            };
            self.counters.parity_members_rebuilt += 1;
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
        step.remaining = self.par().pending();
        Ok(step)
    }

    /// A holder whose offer shrank below the parity pages it holds for us (Nswap §III): only
    /// it knows which groups those are, so it is asked (a scan naming [`SCAN_LEAVING`]).
    /// Returns up to `want` of their members that are their page's current copy and free to
    /// move: the migration writes each again as a new version that joins a new group where
    /// it is (its server tells the old holder to take it out, the old group protecting it
    /// until then, and an emptied group is freed there). Other members are superseded copies,
    /// which leave the group when they are deleted, or pages being written, whose write-back
    /// takes them out (or, written in place, a later scan names them again).
    ///
    /// [`SCAN_LEAVING`]: netram_proto::SCAN_LEAVING
    pub(crate) fn par_release_holder(
        &mut self,
        h: usize,
        want: usize,
    ) -> Result<Vec<u64>, PagerError> {
        self.submit(
            h,
            Op::Scan,
            &Request::ParityScan {
                dead: netram_proto::SCAN_LEAVING,
                max: netram_proto::MAX_BATCH as u32,
            },
        );
        self.drain()?;
        let scanned = std::mem::take(&mut self.par_mut().scanned);
        let mut out = Vec::new();
        for (_, groups, _) in scanned.iter().filter(|(s, _, _)| *s == h) {
            self.counters.parity_groups_leaving += groups.len() as u64;
            for m in groups.iter().flat_map(|g| &g.members) {
                let page = m.key.page;
                if m.key.region != self.cfg.region || page >= self.cfg.pages {
                    continue;
                }
                let e = *self.table.get(page);
                let at = self.par().addrs.iter().position(|&a| a == m.server);
                if e.present
                    && !e.lost
                    && e.version == m.version
                    && at.is_some_and(|s| self.table.holders(page).contains(s))
                    && self.movable(page)
                    && !out.contains(&page)
                {
                    out.push(page);
                }
            }
        }
        out.truncate(want);
        Ok(out)
    }

    /// Whether a rebuilt member is still the page's current version, wanted back.
    pub(super) fn par_wanted(&self, page: u64, version: u32) -> bool {
        if page >= self.cfg.pages || self.writeback.contains_key(&page) {
            return false;
        }
        let e = self.table.get(page);
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
        let e = *self.table.get(page);
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
                self.table.get_mut(m.key.page).lost = true;
                self.counters.pages_unrecoverable += 1;
                step.unrecoverable += 1;
            }
        }
        if !drops.is_empty() {
            self.submit(h, Op::Delta, &Request::ParityDelta(drops));
        }
        let others: Vec<u64> = g
            .members
            .iter()
            .filter(|m| m.server != dead && m.key.page < self.cfg.pages)
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
        self.counters.parity_groups_dissolved += 1;
        let zero = OwnedRecord::default();
        let drops = g
            .members
            .iter()
            .map(|m| drop_delta(g.group, m, &zero))
            .collect();
        self.submit(h, Op::Delta, &Request::ParityDelta(drops));
        for m in &g.members {
            if m.key.region != self.cfg.region || m.key.page >= self.cfg.pages {
                continue;
            }
            if Some(m.server) == dead {
                if self.par_wanted(m.key.page, m.version) {
                    self.table.get_mut(m.key.page).lost = true;
                    self.counters.pages_unrecoverable += 1;
                    step.unrecoverable += 1;
                }
            } else {
                self.par_mut().unprotected.insert(m.key.page);
            }
        }
    }

    /// Audits the groups that overwrites sent elsewhere may have damaged (see
    /// [`Par::suspects`]). It waits until the page's copy on that server has been deleted:
    /// the holder then finds the delete stale, marks the group damaged and reports it to a
    /// scan that names no dead server. Until the audit, the group's other members have no
    /// working parity.
    pub(super) fn par_audit(&mut self, step: &mut RecoveryStep) -> Result<(), PagerError> {
        let settled = |p: &Self, page: u64, s: usize| {
            !p.writeback.contains_key(&page) && !p.par().stale.contains(&(s, p.key(page)))
        };
        if !self
            .par()
            .suspects
            .iter()
            .any(|&(page, s)| settled(self, page, s))
        {
            return Ok(());
        }
        self.counters.parity_audits += 1;
        let asked: Vec<usize> = (0..self.servers.len())
            .filter(|&s| self.servers[s].alive)
            .collect();
        // No server listens on port 0: only damaged groups are reported.
        let nobody = SocketAddr::from(([0, 0, 0, 0], 0));
        for &s in &asked {
            self.submit(
                s,
                Op::Scan,
                &Request::ParityScan {
                    dead: nobody,
                    max: netram_proto::MAX_BATCH as u32,
                },
            );
        }
        self.drain()?;
        let scanned = std::mem::take(&mut self.par_mut().scanned);
        let answered = scanned.len() == asked.len() && asked.iter().all(|s| self.servers[*s].alive);
        let mut found = false;
        for (h, groups, _) in scanned {
            for g in groups.iter().filter(|g| g.damaged) {
                found = true;
                self.par_dissolve(h, g, None, step);
            }
        }
        if answered && !found {
            let suspects = std::mem::take(&mut self.par_mut().suspects);
            let left = suspects
                .into_iter()
                .filter(|&(page, s)| !settled(self, page, s))
                .collect();
            self.par_mut().suspects = left;
        }
        self.pump_all();
        Ok(())
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
                self.table.get_mut(page).lost = true;
                self.counters.pages_unrecoverable += 1;
                step.unrecoverable += 1;
            }
        }
    }

    /// Pages stored outside any group join one again, where they are (read first, unless
    /// cached).
    pub(super) fn par_reprotect(
        &mut self,
        max: usize,
        step: &mut RecoveryStep,
    ) -> Result<(), PagerError> {
        let budget = (self.free_slots.len() / 2).min(max);
        let mut batch = Vec::new();
        while batch.len() < budget {
            let Some(page) = self.par_mut().unprotected.pop_first() else {
                break;
            };
            let e = *self.table.get(page);
            if !e.present || e.lost || self.writeback.contains_key(&page) {
                continue;
            }
            let Some(s) = self.alive_holder(page, None) else {
                continue;
            };
            batch.push((page, s));
        }
        if batch.is_empty() {
            return Ok(());
        }
        let mut asked = BTreeSet::new();
        for &(page, s) in &batch {
            let slot = self.take_slot()?;
            asked.insert((page, slot));
            let it = self.page_get_item(page, slot, INTERNAL);
            self.submit_get_item(
                s,
                GetItem {
                    part: Part::Survivor,
                    ..it
                },
            );
        }
        self.par_drain()?;
        self.par_mut().read_failed.clear();
        // (Other reads of the pager's own, a move's, stay for their step.)
        let fetched: Vec<(u64, u32)>;
        (fetched, self.fetched) = std::mem::take(&mut self.fetched)
            .into_iter()
            .partition(|f| asked.contains(f));
        for (page, slot) in fetched {
            let e = *self.table.get(page);
            if !e.present || e.lost || self.writeback.contains_key(&page) {
                self.release_slot(slot);
                continue;
            }
            if !self.unseal_slot(page, e.version, slot) {
                // Read back raw, and not what this pager sealed: tried again later.
                self.release_slot(slot);
                continue;
            }
            self.counters.parity_reprotected += 1;
            step.started += 1;
            self.par_rewrite(page, slot, false)?;
        }
        for (page, _) in batch {
            let e = *self.table.get(page);
            if !self.writeback.contains_key(&page) && e.present && !e.lost {
                // Its read failed on the way: try again later.
                self.par_mut().unprotected.insert(page);
            }
        }
        self.par_seal(None)?;
        self.pump_all();
        Ok(())
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
            if k.page < self.cfg.pages && self.writeback.contains_key(&k.page) {
                self.par_mut().stale.push((s, k));
                continue;
            }
            let current = k.page < self.cfg.pages
                && self.table.holders(k.page).contains(s)
                && !self.table.get(k.page).lost;
            if current || !self.servers[s].alive {
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
            self.counters.deletes += 1;
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
