//! Reed-Solomon recovery and degraded reads: pieces fetched from K survivors, decoded (one
//! decoder per erasure pattern, a plain XOR where one lost piece allows it) and written to
//! servers the stripe does not use yet, streamed so that the next stripes' reads are on the
//! wire while these are rebuilt (paper 004 §IV-B3's recovery, for stripes). Kept apart from
//! writing and sealing stripes (`mod.rs`): this half runs only when a piece is out of reach.

use super::*;

impl<T: Transport, D: Disk> Pager<T, D> {
    /// Reads pieces of a stripe into fresh slots, pipelined; returns those that came back
    /// good, as (piece, slot).
    pub(super) fn rs_fetch(
        &mut self,
        id: u32,
        pieces: &[usize],
    ) -> Result<Vec<(usize, u32)>, PagerError> {
        for &piece in pieces {
            let slot = self.take_slot()?;
            let stripe = &self.rs().stripes[id as usize];
            let server = usize::from(stripe.servers[piece]);
            let it = GetItem {
                page: u64::from(id),
                slot,
                pos: INTERNAL,
                key: self.piece_key(id, piece),
                version: stripe.version(piece),
                part: Part::Piece(piece as u8),
            };
            self.submit_get_item(server, it);
        }
        while !self.idle() {
            self.complete_one()?;
        }
        let mine = |d: &ReadDone| {
            matches!(d.part, Part::Piece(_)) && d.pos == INTERNAL && d.page == u64::from(id)
        };
        let got = self
            .take_reads_done(mine)
            .into_iter()
            .map(|d| match d.part {
                Part::Piece(piece) => (usize::from(piece), d.slot),
                _ => unreachable!("taken for being a piece"),
            });
        Ok(got.collect())
    }

    /// Decodes a stripe's data pieces from any K of its live pieces (not those in `avoid`):
    /// returns the data pieces `wanted` as (piece, slot), or `None` when too few pieces
    /// answered.
    ///
    /// With `fetch`, pieces not at hand are read, waiting for them (a waiting read's
    /// decode); without, only the pieces at hand are used (a rebuild, whose missing pieces
    /// `rs_top_up` asked for beforehand).
    pub(super) fn rs_decode(
        &mut self,
        id: u32,
        wanted: &[usize],
        avoid: &[usize],
        fetch: bool,
    ) -> Result<Option<Vec<(usize, u32)>>, PagerError> {
        let pinned_here = self.rs_mut().pinned.insert(id);
        let decoded = self.rs_decode_pinned(id, wanted, avoid, fetch);
        if pinned_here {
            self.rs_mut().pinned.remove(&id);
        }
        let decoded = decoded?;
        let rs = self.rs();
        if !rs.stripes[id as usize].in_use() && !rs.writing.contains_key(&id) {
            // Its last member died meanwhile: nothing to rebuild or read.
            if let Some(v) = &decoded {
                for &(_, slot) in v {
                    self.release_slot(slot);
                }
            }
            self.rs_free(id);
            return Ok(None);
        }
        Ok(decoded)
    }

    pub(super) fn rs_decode_pinned(
        &mut self,
        id: u32,
        wanted: &[usize],
        avoid: &[usize],
        fetch: bool,
    ) -> Result<Option<Vec<(usize, u32)>>, PagerError> {
        let stripe = &self.rs().stripes[id as usize];
        let (k, m) = (stripe.k(), stripe.servers.len() - stripe.k());
        let total = stripe.servers.len();
        let mut candidates: Vec<usize> = (0..total)
            .filter(|&j| {
                let s = stripe.servers[j];
                !avoid.contains(&j) && s != NO_SERVER && self.server_states()[usize::from(s)].alive
            })
            .collect();
        // One piece out of reach of a code whose pieces XOR to zero: the others give it by
        // XOR, one read more than K but no decoder.
        let xor = self.rs().xor_code(k) && candidates.len() + 1 == total;
        let need = if xor { total - 1 } else { k };
        let mut have: Vec<(usize, u32)> = Vec::new();
        for j in 0..k {
            if let Some(slot) = self.rs_mut().restored.remove(&(id, j)) {
                candidates.retain(|&c| c != j);
                have.push((j, slot));
            }
        }
        for j in 0..total {
            if let Some(slot) = self.rs_mut().prefetched.remove(&(id, j)) {
                if have.len() < need && !avoid.contains(&j) {
                    candidates.retain(|&c| c != j);
                    have.push((j, slot));
                } else {
                    self.release_slot(slot);
                }
            }
        }
        // The wanted pieces not at hand: how many, and the first.
        let missing = |have: &[(usize, u32)]| -> (usize, Option<usize>) {
            let mut absent = wanted
                .iter()
                .copied()
                .filter(|&j| !have.iter().any(|&(i, _)| i == j));
            let first = absent.next();
            (first.map_or(0, |_| 1 + absent.count()), first)
        };
        while fetch && missing(&have).0 > 0 && have.len() < need && !candidates.is_empty() {
            let n = (need - have.len()).min(candidates.len());
            let batch: Vec<usize> = candidates.drain(..n).collect();
            have.extend(self.rs_fetch(id, &batch)?);
        }
        if let (1, Some(x)) = missing(&have) {
            if xor && have.len() == total - 1 {
                let slot = self.take_slot()?;
                self.rs_xor_of(slot, &have);
                self.counters_mut().pieces_restored_by_xor += 1;
                have.push((x, slot));
            }
        }
        let absent = missing(&have).0 > 0;
        if absent && have.len() < k {
            for (_, slot) in have {
                self.release_slot(slot);
            }
            return Ok(None);
        }
        let decoded = if !absent {
            BTreeMap::new()
        } else {
            // Any K pieces, data first: the decoder gives back the data pieces missing.
            have.sort_unstable_by_key(|&(j, _)| j);
            self.counters_mut().decoder_runs += 1;
            let slots = self.slot_pool();
            let shard =
                |slot: u32| &slots[slot as usize * PAGE_SIZE..(slot as usize + 1) * PAGE_SIZE];
            let originals = have[..k]
                .iter()
                .filter(|(j, _)| *j < k)
                .map(|&(j, s)| (j, shard(s)));
            let recovery = have[..k]
                .iter()
                .filter(|(j, _)| *j >= k)
                .map(|&(j, s)| (j - k, shard(s)));
            reed_solomon_simd::decode(k, m, originals, recovery)
                .expect("K pieces of page size decode")
        };
        let mut out = Vec::with_capacity(wanted.len());
        for &j in wanted {
            // A piece that was read is handed over in its own slot; a decoded one is copied in.
            if let Some(at) = have.iter().position(|&(i, _)| i == j) {
                out.push(have.swap_remove(at));
                continue;
            }
            let slot = self.take_slot()?;
            self.slot_mut(slot)
                .copy_from_slice(decoded.get(&j).expect("decoded every missing data piece"));
            out.push((j, slot));
        }
        // Parity wanted back is computed from the data pieces, all known by now.
        for (_, slot) in have {
            self.release_slot(slot);
        }
        Ok(Some(out))
    }

    /// `dst` = the XOR of the pieces in `pieces`' slots (none of them `dst`).
    pub(super) fn rs_xor_of(&mut self, dst: u32, pieces: &[(usize, u32)]) {
        let mut out = [0u8; PAGE_SIZE];
        let srcs: Vec<&[u8]> = pieces.iter().map(|&(_, s)| self.slot(s)).collect();
        netram_proto::parity::xor_of(&mut out, &srcs);
        self.slot_mut(dst).copy_from_slice(&out);
    }

    /// A degraded read: the page's data piece is out of reach, so it is decoded from K other
    /// pieces of its stripe into `slot`. False when too few pieces answered.
    pub(crate) fn rs_reconstruct(&mut self, page: u64, slot: u32) -> Result<bool, PagerError> {
        let rs = self.rs();
        let id = rs.stripe_of[page as usize];
        if id == NO_STRIPE {
            return Ok(false);
        }
        let i = usize::from(rs.index_of[page as usize]);
        match self.rs_decode(id, &[i], &[i], true)? {
            Some(v) => {
                let (_, s) = v[0];
                self.copy_slot(s, slot);
                self.release_slot(s);
                self.rs_mut().degraded.insert(id);
                // Decoded ciphertext: it must be what this pager sealed (a piece that lied in
                // a way its crc32c could not see makes a page that does not open).
                let version = self.table().get(page).version;
                if !self.unseal_slot(page, version, slot) {
                    return Ok(false);
                }
                self.counters_mut().degraded_reads += 1;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// The pieces of `id` lost (no server, or a dead one), and the live ones to read to
    /// rebuild them: every other piece where one lost data piece is their XOR
    /// ([`xor_code`]), otherwise K (the K data pieces where only parity is lost). `None` when
    /// nothing is to be done: the stripe is being written, unused, or whole.
    pub(super) fn rs_read_plan(&self, id: u32) -> Option<(Vec<usize>, Vec<usize>)> {
        let rs = self.rs();
        if rs.writing.contains_key(&id) {
            return None; // its write settles it
        }
        let st = &rs.stripes[id as usize];
        if !st.in_use() {
            return None;
        }
        let (k, total) = (st.k(), st.servers.len());
        let up = |j: usize| {
            st.servers[j] != NO_SERVER && self.server_states()[usize::from(st.servers[j])].alive
        };
        let (mut live, lost): (Vec<usize>, Vec<usize>) = (0..total).partition(|&j| up(j));
        if lost.is_empty() {
            return None;
        }
        let lost_data = lost.iter().any(|&j| j < k);
        if !(lost_data && lost.len() == 1 && rs.xor_code(k)) {
            live.truncate(k);
        }
        Some((lost, live))
    }

    /// Piece reads of recovery's that came back, put where `rs_decode` finds them; those for
    /// a stripe no longer being rebuilt (given up, `rs_yield`) or of another version of the
    /// piece (the stripe's number reused since) are let go.
    pub(super) fn rs_harvest(&mut self) {
        let mine = |d: &ReadDone| matches!(d.part, Part::Piece(_)) && d.pos == RECOVERY;
        for d in self.take_reads_done(mine) {
            let Part::Piece(piece) = d.part else {
                unreachable!("taken for being a piece")
            };
            let (id, piece) = (d.page as u32, usize::from(piece));
            let rs = self.rs_mut();
            let current = rs
                .stripes
                .get(id as usize)
                .is_some_and(|st| piece < st.servers.len() && st.version(piece) == d.version);
            if !rs.reading.contains_key(&id) || !current {
                self.release_slot(d.slot);
                continue;
            }
            rs.settle(id);
            if let Some(old) = rs.prefetched.insert((id, piece), d.slot) {
                self.release_slot(old);
            }
        }
    }

    /// A piece read for a stripe being rebuilt that will not come back.
    pub(crate) fn rs_read_settled(&mut self, id: u32) {
        if let Some(rs) = self.state_mut::<Rs>() {
            rs.settle(id);
        }
    }

    /// Decodes the missing data pieces of the prefetched stripes, one `reed-solomon-simd` call
    /// per erasure pattern for all the stripes that share it: its decoder has a fixed cost (an
    /// evaluation over the whole field, ~0.25 ms here) that would otherwise be paid per
    /// stripe. Bytes at the same offset of different stripes never mix in Reed-Solomon, so
    /// stripes laid end to end decode as one.
    pub(super) fn rs_decode_batch(&mut self, ids: &BTreeSet<u32>) -> Result<(), PagerError> {
        let mut groups: BTreeMap<(usize, usize, Vec<usize>), Vec<u32>> = BTreeMap::new();
        for &id in ids {
            let rs = self.rs();
            let st = &rs.stripes[id as usize];
            let (k, total) = (st.k(), st.servers.len());
            let present: Vec<(usize, u32)> = (0..total)
                .filter_map(|j| rs.prefetched.get(&(id, j)).map(|&s| (j, s)))
                .collect();
            let absent = (0..k).any(|j| !present.iter().any(|&(i, _)| i == j));
            if absent && present.len() == k {
                let present = present.iter().map(|&(j, _)| j).collect();
                groups.entry((k, total - k, present)).or_default().push(id);
            }
        }
        for ((k, m, present), ids) in groups {
            let n = ids.len();
            let shard = |pager: &Self, j: usize| -> Vec<u8> {
                let mut v = Vec::with_capacity(n * PAGE_SIZE);
                for &id in &ids {
                    v.extend_from_slice(pager.slot(pager.rs().prefetched[&(id, j)]));
                }
                v
            };
            let originals: Vec<(usize, Vec<u8>)> = present
                .iter()
                .filter(|&&j| j < k)
                .map(|&j| (j, shard(self, j)))
                .collect();
            let recovery: Vec<(usize, Vec<u8>)> = present
                .iter()
                .filter(|&&j| j >= k)
                .map(|&j| (j - k, shard(self, j)))
                .collect();
            self.counters_mut().decoder_runs += 1;
            let decoded = reed_solomon_simd::decode(k, m, originals, recovery)
                .expect("K pieces of equal size decode");
            for (j, bytes) in decoded {
                for (t, &id) in ids.iter().enumerate() {
                    let slot = self.take_slot()?;
                    self.slot_mut(slot)
                        .copy_from_slice(&bytes[t * PAGE_SIZE..(t + 1) * PAGE_SIZE]);
                    self.rs_mut().restored.insert((id, j), slot);
                }
            }
        }
        Ok(())
    }

    /// Rebuilds the lost pieces of up to `max` degraded stripes, streaming and never waiting:
    /// a step takes in the piece reads that are back, rebuilds those stripes and writes their
    /// pieces, sends the reads of the next stripes as far as the slots allow, and returns; the
    /// next step goes on from there (the replies come in meanwhile, to whoever reads them).
    /// Stripes that need the decoder wait for a batch (`rs_decode_batch`).
    pub(crate) fn rs_recover(&mut self, max: usize) -> Result<RecoveryStep, PagerError> {
        let mut step = RecoveryStep::default();
        self.poll()?;
        let mut plan: VecDeque<u32> = VecDeque::new();
        self.rs_mut().streaming = true;
        let streamed = self.rs_stream(&mut plan, max, &mut step);
        self.rs_mut().streaming = false;
        // Stripes not started go back on the list.
        self.rs_mut().degraded.extend(plan);
        if streamed.is_err() {
            // Whatever was under way goes back on the list too, unpinned.
            self.rs_yield();
        }
        self.rs_release_unclaimed();
        streamed?;
        self.send_queued();
        step.remaining = self.rs_degraded();
        Ok(step)
    }

    /// Gives up the rebuilds under way (their reads not out: they are answered or failed)
    /// and puts their stripes back on the list, so that their slots serve a caller that has
    /// none; whether any slot came free.
    pub(crate) fn rs_yield(&mut self) -> bool {
        if self.state::<Rs>().is_none_or(|rs| rs.streaming) {
            return false;
        }
        self.rs_harvest();
        let before = self.free_slot_count();
        let rs = self.rs_mut();
        let unfinished: Vec<u32> = rs
            .reading
            .drain()
            .map(|(id, _)| id)
            .chain(rs.read.drain(..))
            .chain(rs.decode_wait.drain(..))
            .collect();
        for id in unfinished {
            self.rs_release_pin(id);
            self.rs_mut().degraded.insert(id);
        }
        self.rs_release_unclaimed();
        self.free_slot_count() > before
    }

    /// Gives up, for now, the rebuilds of stripes whose pieces are read (no room to decode and
    /// write them): their pieces' slots go back, and the stripes back on recovery's list.
    fn rs_defer(&mut self, ids: &[u32]) {
        if ids.is_empty() {
            return;
        }
        for &id in ids {
            self.rs_mut().decode_wait.retain(|&d| d != id);
            self.rs_release_pin(id);
            self.rs_mut().degraded.insert(id);
        }
        self.counters_mut().rebuilds_deferred += ids.len() as u64;
        self.rs_release_unclaimed();
    }

    /// Lets go of the pieces read or decoded for stripes no longer being rebuilt (a degraded
    /// read's decode that left some, a stripe given up).
    fn rs_release_unclaimed(&mut self) {
        let rs = self.rs_mut();
        let mut left = Vec::new();
        let mut keep = |rs: &Rs, &(id, _): &(u32, usize), &slot: &u32| {
            let b = rs.under_way(id);
            if !b {
                left.push(slot);
            }
            b
        };
        let prefetched: HashMap<(u32, usize), u32> = std::mem::take(&mut rs.prefetched)
            .into_iter()
            .filter(|(k, v)| keep(rs, k, v))
            .collect();
        rs.prefetched = prefetched;
        let restored: HashMap<(u32, usize), u32> = std::mem::take(&mut rs.restored)
            .into_iter()
            .filter(|(k, v)| keep(rs, k, v))
            .collect();
        rs.restored = restored;
        for slot in left {
            self.release_slot(slot);
        }
    }

    /// Unpins a stripe, and frees it if its last member died while it was pinned.
    pub(super) fn rs_release_pin(&mut self, id: u32) {
        let rs = self.rs_mut();
        rs.pinned.remove(&id);
        rs.asked.remove(&id);
        let st = &rs.stripes[id as usize];
        // A freed stripe has no servers: freed once only.
        if !st.in_use() && !st.servers.is_empty() && !rs.writing.contains_key(&id) {
            self.rs_free(id);
        }
    }

    /// The loop of [`Pager::rs_recover`]: stripes come off the list into `plan`, leave it as
    /// their reads go out, are pinned until rebuilt (a write-back that kills their last
    /// member must not free them, and their number be reused, under the reads), and wait in
    /// `decode_wait` for the decoder. Returns when what is left waits for replies.
    pub(super) fn rs_stream(
        &mut self,
        plan: &mut VecDeque<u32>,
        max: usize,
        step: &mut RecoveryStep,
    ) -> Result<(), PagerError> {
        let rs = self.rs();
        let total = rs.k + rs.m;
        // Per stripe: up to K+M−1 pieces read and M restored; what is left lets a stripe whose
        // reads failed fetch others (`rs_decode`).
        let (per_stripe, reserve) = (total + rs.m, 2 * total + 2);
        // What a read stripe's rebuild takes at most: its decoded pieces and its parity. A
        // stripe read when slots were free may find them taken by the time its pieces are in
        // (a tick runs between the program's operations): it is rebuilt later, not waited
        // for (taking a slot with none free waits for replies, and recovery never waits).
        let room = 2 * rs.m;
        loop {
            // Topped up as stripes' reads come back: at most `max` with reads out, so that
            // the reads of the next ones go out in the step that rebuilds these (what is read
            // is rebuilt, or waits for the decoder, before the step returns). Counting the
            // stripes read as well halved the stripes under way (bench reliability: 1.9-2.0 s
            // of background recovery against 1.4-1.5).
            self.rs_harvest();
            let mut later = Vec::new();
            while plan.len() + self.rs().reading.len() < max {
                let rs = self.rs_mut();
                let Some(id) = rs.degraded.pop_first() else {
                    break;
                };
                if rs.under_way(id) {
                    // Degraded again (another death) while its rebuild is under way: looked
                    // at again once that is done, never rebuilt twice at once.
                    later.push(id);
                    continue;
                }
                plan.push_back(id);
            }
            self.rs_mut().degraded.extend(later);
            while let Some(&id) = plan.front() {
                if self.free_slot_count() < reserve + per_stripe {
                    break;
                }
                plan.pop_front();
                self.rs_start(id)?;
            }
            self.send_queued();
            self.rs_harvest();
            while let Some(id) = self.rs_mut().read.pop() {
                let rs = self.rs();
                let st = &rs.stripes[id as usize];
                let k = st.k();
                let by_decoder = (0..k).any(|j| !rs.prefetched.contains_key(&(id, j)))
                    && (k..st.servers.len()).any(|j| rs.prefetched.contains_key(&(id, j)))
                    && !rs.xor_code(k);
                if by_decoder {
                    self.rs_mut().decode_wait.push(id);
                } else if self.free_slot_count() < room {
                    self.rs_defer(&[id]);
                } else {
                    self.rs_rebuild(id, step)?;
                }
            }
            let rs = self.rs();
            let busy = !rs.reading.is_empty() || !rs.read.is_empty();
            // Decoded in batches of 64, or whatever waits once no read is out.
            if rs.decode_wait.len() >= 64 || (!busy && !rs.decode_wait.is_empty()) {
                let fit = self.free_slot_count() / room;
                let rs = self.rs_mut();
                let later = rs.decode_wait.len().saturating_sub(fit);
                let later: Vec<u32> = rs.decode_wait.drain(..later).collect();
                self.rs_defer(&later);
                let ids: BTreeSet<u32> = self.rs().decode_wait.iter().copied().collect();
                self.rs_decode_batch(&ids)?;
                while let Some(id) = self.rs_mut().decode_wait.pop() {
                    self.rs_rebuild(id, step)?;
                }
                continue;
            }
            if plan.is_empty() && !busy {
                return Ok(());
            }
            if !busy && self.idle() && self.free_slot_count() < reserve + per_stripe {
                // No room, and nothing under way to make some: the rest waits for a later call.
                return Ok(());
            }
            if self.rs().read.is_empty() {
                if self.idle() {
                    // Nothing in flight: what came back is in `reads_done`. Reads still counted
                    // out after that will never be answered: rebuild with what came back
                    // (`rs_decode` fetches the rest) rather than wait forever.
                    self.rs_harvest();
                    let rs = self.rs_mut();
                    if rs.read.is_empty() {
                        let stuck: Vec<u32> = rs.reading.drain().map(|(id, _)| id).collect();
                        rs.read.extend(stuck);
                    }
                    continue;
                }
                // Reads are out: a later step takes their replies in.
                return Ok(());
            }
        }
    }

    /// Starts rebuilding stripe `id`: pins it and queues the reads of its live pieces (tagged
    /// [`RECOVERY`], taken in by `rs_harvest`); false when there is nothing to rebuild (see
    /// `rs_read_plan`). Its caller has checked that the slots are free.
    fn rs_start(&mut self, id: u32) -> Result<bool, PagerError> {
        let Some((_, read)) = self.rs_read_plan(id) else {
            return Ok(false);
        };
        let rs = self.rs_mut();
        rs.pinned.insert(id);
        rs.asked.insert(id, read.iter().fold(0, |m, &j| m | 1 << j));
        if read.is_empty() {
            rs.read.push(id);
        } else {
            rs.reading.insert(id, read.len() as u32);
        }
        self.rs_queue_pieces(id, &read)
    }

    /// Queues the reads of pieces `pieces` of stripe `id` (tagged [`RECOVERY`], taken in by
    /// `rs_harvest`); never waits: the caller has checked that the slots are free.
    fn rs_queue_pieces(&mut self, id: u32, pieces: &[usize]) -> Result<bool, PagerError> {
        for &j in pieces {
            let slot = self.take_slot()?;
            let st = &self.rs().stripes[id as usize];
            let it = GetItem {
                page: u64::from(id),
                slot,
                pos: RECOVERY,
                key: self.piece_key(id, j),
                version: st.version(j),
                part: Part::Piece(j as u8),
            };
            // Queued, never waited for: a full window sends it later.
            self.queue_get(usize::from(st.servers[j]), it);
        }
        Ok(true)
    }

    /// Moves the degraded reads by ticket on ([`Rs::waiters`]), never waiting: a read waits
    /// for its stripe's rebuild, which decodes its page on the way (`rs_serve_from`). The
    /// stripe's rebuild is started here if recovery has not started it (and the slots allow:
    /// else at a later call, or by recovery), and rebuilt here as soon as its pieces are in,
    /// not at recovery's next step. A read whose page came within reach some other way
    /// (rebuilt and stored, written, gone to the disk) or is lost starts again the ordinary
    /// way. Before, a degraded read decoded its page when its ticket was taken, waiting for
    /// every reply in flight under the region's lock.
    pub(crate) fn rs_serve_waiters(&mut self) -> Result<(), PagerError> {
        self.rs_harvest();
        let rs = self.rs();
        let wanted = |id: u32| {
            rs.waiters
                .iter()
                .any(|it| rs.stripe_of[it.page as usize] == id)
        };
        let ready: Vec<u32> = rs
            .read
            .iter()
            .chain(&rs.decode_wait)
            .copied()
            .filter(|&id| wanted(id))
            .collect();
        let mut step = RecoveryStep::default();
        for id in ready {
            let rs = self.rs_mut();
            rs.read.retain(|&x| x != id);
            rs.decode_wait.retain(|&x| x != id);
            self.rs_rebuild(id, &mut step)?;
        }
        // Room for a stripe's piece reads (K+M-1 at most) and the pieces its rebuild
        // restores (M at most), with room to spare: a start never waits for a slot.
        let rs = self.rs();
        let per_stripe = 2 * (rs.k + rs.m);
        for it in std::mem::take(&mut self.rs_mut().waiters) {
            if !self.waits_for_recovery(&it) {
                self.restart_waiter(it);
                continue;
            }
            let id = self.rs().stripe_of[it.page as usize];
            let rs = self.rs();
            let started = rs.under_way(id) || rs.writing.contains_key(&id);
            if !started && self.free_slot_count() >= per_stripe {
                // Not given up for a slot while its reads are being queued.
                self.rs_mut().streaming = true;
                let r = self.rs_start(id);
                self.rs_mut().streaming = false;
                if r? {
                    self.rs_mut().degraded.remove(&id);
                }
            }
            self.rs_mut().waiters.push(it);
        }
        self.send_queued();
        Ok(())
    }

    /// Serves the degraded reads by ticket waiting for stripe `id` from its data pieces, just
    /// decoded by its rebuild (`data`: piece, slot), if their page is still that member.
    fn rs_serve_from(&mut self, id: u32, data: &[(usize, u32)]) {
        if self.rs().waiters.is_empty() {
            return;
        }
        for it in std::mem::take(&mut self.rs_mut().waiters) {
            let rs = self.rs();
            let page = it.page as usize;
            let piece = usize::from(rs.index_of[page]);
            let e = *self.table().get(it.page);
            let from = data
                .iter()
                .find(|&&(j, _)| j == piece)
                .map(|&(_, slot)| slot)
                .filter(|_| {
                    rs.stripe_of[page] == id
                        && e.present
                        && !e.lost
                        && e.version == it.version
                        && !self.cached(it.page)
                        && !self.writebacks().contains_key(&it.page)
                });
            let Some(from) = from else {
                self.rs_mut().waiters.push(it);
                continue;
            };
            self.copy_slot(from, it.slot);
            // Decoded ciphertext: it must be what this pager sealed (see `rs_reconstruct`).
            if self.unseal_slot(it.page, it.version, it.slot) {
                self.counters_mut().degraded_reads += 1;
                self.reconstructed(&it);
            } else {
                self.reconstruction_failed(&it);
            }
        }
    }

    /// Before a rebuild decodes stripe `id`: where reads failed and the pieces at hand are
    /// too few, asks live pieces not asked yet for it (as many as are missing) and returns
    /// true: the stripe waits in `reading` for them, still pinned, and is rebuilt when they
    /// are in. False when the pieces at hand do, or no other piece can be asked now (then
    /// the decode finds too few, and the stripe is tried again at a later step). Before, the
    /// decode read the other pieces itself and waited for them (`rs_fetch`), under the
    /// region's lock.
    fn rs_top_up(&mut self, id: u32, wanted: &[usize], lost: &[usize]) -> Result<bool, PagerError> {
        let rs = self.rs();
        let st = &rs.stripes[id as usize];
        let (k, total) = (st.k(), st.servers.len());
        let alive = |j: usize| {
            let s = st.servers[j];
            !lost.contains(&j) && s != NO_SERVER && self.server_states()[usize::from(s)].alive
        };
        // What the decode would use (see `rs_decode_pinned`).
        let at_hand = |j: usize| {
            (j < k && rs.restored.contains_key(&(id, j)))
                || (!lost.contains(&j) && rs.prefetched.contains_key(&(id, j)))
        };
        let have = (0..total).filter(|&j| at_hand(j)).count();
        let live = (0..total).filter(|&j| alive(j)).count();
        let need = if rs.xor_code(k) && live + 1 == total {
            total - 1
        } else {
            k
        };
        if wanted.iter().all(|&j| at_hand(j)) || have >= need {
            return Ok(false);
        }
        let asked = rs.asked.get(&id).copied().unwrap_or(0);
        let more: Vec<usize> = (0..total)
            .filter(|&j| alive(j) && !at_hand(j) && asked & (1 << j) == 0)
            .take(need - have)
            .collect();
        // Room for them beside what a stripe's rebuild takes (`rs_stream`'s reserve).
        if more.is_empty() || self.free_slot_count() < more.len() + 2 * total {
            return Ok(false);
        }
        let rs = self.rs_mut();
        *rs.asked.entry(id).or_default() |= more.iter().fold(0, |m, &j| m | 1 << j);
        rs.reading.insert(id, more.len() as u32);
        self.counters_mut().pieces_asked_again += more.len() as u64;
        self.rs_queue_pieces(id, &more)?;
        self.send_queued();
        Ok(true)
    }

    /// Restores and writes out the lost pieces of one stripe whose reads are back (in
    /// `prefetched` and `restored`; `rs_decode` fetches what is missing).
    pub(super) fn rs_rebuild(
        &mut self,
        id: u32,
        step: &mut RecoveryStep,
    ) -> Result<(), PagerError> {
        let r = self.rs_rebuild_pinned(id, step);
        if !matches!(r, Ok(true)) {
            self.rs_release_pin(id);
        }
        r.map(|_| ())
    }

    /// True when the stripe waits for more of its pieces (`rs_top_up`): still pinned.
    pub(super) fn rs_rebuild_pinned(
        &mut self,
        id: u32,
        step: &mut RecoveryStep,
    ) -> Result<bool, PagerError> {
        let Some((lost, _)) = self.rs_read_plan(id) else {
            return Ok(false); // its last member died while it was read
        };
        let rs = self.rs();
        let st = &rs.stripes[id as usize];
        let k = st.k();
        let members = st.members.clone();
        let live = st.live.clone();
        let parity_lost = lost.iter().any(|&j| j >= k);
        // Every data piece: parity is recomputed from them, and should the rebuilt pieces
        // find too few servers, the live members go to the local disk from them.
        let wanted: Vec<usize> = (0..k).collect();
        if self.rs_top_up(id, &wanted, &lost)? {
            return Ok(true);
        }
        let Some(restored) = self.rs_decode(id, &wanted, &lost, false)? else {
            // Fewer than K pieces answered. If K are still out there (a read failed on
            // the way), try again later; otherwise the members whose data piece is gone
            // and that have no disk copy are lost: their reads fail from now on.
            let st = &self.rs().stripes[id as usize];
            if st.in_use() && self.rs_live_pieces(id) >= st.k() {
                self.rs_mut().degraded.insert(id);
                return Ok(false);
            }
            for (i, &(page, _)) in members.iter().enumerate() {
                let rs = self.rs();
                if live[i]
                    && rs.stripe_of[page as usize] == id
                    && lost.contains(&i)
                    && !self.table().get(page).on_disk
                {
                    step.unrecoverable += 1;
                    self.counters_mut().pages_unrecoverable += 1;
                }
            }
            return Ok(false);
        };
        self.rs_serve_from(id, &restored);
        let total = self.rs().stripes[id as usize].servers.len();
        let mut slots = vec![u32::MAX; total];
        let mut owned = Vec::new();
        for &(j, slot) in &restored {
            if lost.contains(&j) {
                slots[j] = slot;
                owned.push(slot);
            }
        }
        if parity_lost {
            let mut parity = Vec::with_capacity(total - k);
            for _ in k..total {
                parity.push(self.take_slot()?);
            }
            let data: Vec<u32> = restored.iter().map(|&(_, s)| s).collect();
            self.rs_encode(&data, &parity);
            for (p, slot) in parity.into_iter().enumerate() {
                if lost.contains(&(k + p)) {
                    slots[k + p] = slot;
                    owned.push(slot);
                } else {
                    self.release_slot(slot);
                }
            }
        }
        let data: Vec<u32> = restored.iter().map(|&(_, s)| s).collect();
        for &(j, slot) in &restored {
            if !lost.contains(&j) {
                owned.push(slot);
            }
        }
        let revivals = self.counters_mut().servers_revived;
        let rs = self.rs_mut();
        for &j in &lost {
            rs.stripes[id as usize].servers[j] = NO_SERVER;
        }
        rs.writing
            .insert(id, StripeWrite::new(slots, owned, true, data, revivals));
        step.started += lost.len();
        self.rs_place(id)?;
        Ok(false)
    }

    /// A page's data piece could not be read: decoded from the rest of its stripe, unless the
    /// disk has a copy.
    pub(crate) fn rs_get_failed(&mut self, server: usize, it: GetItem, what: Option<&'static str>) {
        // A GET of a version written over since (a move's read, out while the page was
        // written again) says nothing of the piece the table names now, which may be the new
        // version's stripe or still the old one's: blaming it would drop a good piece.
        let current = it.version == self.table().get(it.page).version;
        if !current && it.pos == INTERNAL {
            // The move sees the page changed and leaves it to what changed it.
            self.own_read_failed(it.page);
            return self.release_slot(it.slot);
        }
        if let (Some(what), Some(key), true) = (what, self.rs_key(it.page), current) {
            let (id, piece) = ((key.page / 32) as u32, (key.page % 32) as u8);
            self.rs_bad_piece(id, piece, server, what);
        }
        let e = *self.table().get(it.page);
        if it.pos != INTERNAL && !e.on_disk && self.rs_reconstructible(it.page) {
            self.reconstruct_later(it);
            return;
        }
        self.disk_copy_or_report(server, it, what)
    }
}
