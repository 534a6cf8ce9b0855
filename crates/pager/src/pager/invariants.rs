//! What must hold of a pager between any two calls, checked from its own state: the simulator
//! calls [`Pager::check_invariants`] after every step (as it checks the stores), so a bookkeeping
//! slip is caught where it happens rather than pages later as a wrong read.
//!
//! * **Slots are conserved**: every page buffer is in exactly one place — free, cached, the
//!   data of one write-back, carried by one GET (queued, in flight, to retry, to reconstruct,
//!   done), or owned by the redundancy scheme — and a PUT carries a slot some write-back or
//!   stripe write owns.
//! * **A waiting read counts its own reads**: the caller's GETs queued, in flight, to retry,
//!   to decode or done are as many as it waits for.
//! * **Credits equal the operations in flight**: per server, the credits taken are the sum
//!   of what its requests in flight hold, within its window (a batch larger than the window
//!   goes out alone).
//! * **Holders agree with the table**: holders are distinct servers the pager knows, never
//!   more than the scheme keeps; a write-back's page is in the table; its copies in flight,
//!   acknowledged and refused are distinct servers, and every copy in flight is carried by a
//!   PUT of that page and version.
//! * **Handling a reply never waits**: a request that finds no credit, or a slot taken while
//!   a reply is handled, queues or is found without reading another reply, so that replies
//!   can be delivered as events (one at a time, in any order, to any client).
//! * The cache holds at most its budget, plus the pages whose disk write failed (each of
//!   them cached and dirty); only cached slots are dirty; recovery's lists name pages the
//!   table has.

use crate::requests::PutKind;
use crate::{Disk, Op, Pager, Transport};

impl<T: Transport, D: Disk> Pager<T, D> {
    /// Checks the pager's own bookkeeping; the first violation found, in words.
    pub fn check_invariants(&self) -> Result<(), String> {
        if self.forbidden_waits > 0 {
            return Err(format!(
                "handling a reply or a non-waiting write waited {} times: requests without \
                 credits must queue, not wait",
                self.forbidden_waits
            ));
        }
        self.check_slots()?;
        self.check_caller_reads()?;
        self.check_credits()?;
        self.check_table()?;
        self.check_moves()?;
        // A page on its way off a leaving server is in write-back until it lands.
        if let Some(p) = self
            .migrating
            .iter()
            .find(|p| !self.writeback.contains_key(p))
        {
            return Err(format!("page {p} is migrating but not in write-back"));
        }
        Ok(())
    }

    /// A move through this pager holds its read's slot until its next step: the read is
    /// queued, in flight, to be tried again or decoded, done, or failed (then its step
    /// forgets the move). A move whose read went nowhere would be due forever.
    fn check_moves(&self) -> Result<(), String> {
        let mut reading: Vec<(u64, u32)> = Vec::new();
        for (_, op, _) in self.requests() {
            if let Op::Get(items) = op {
                reading.extend(items.iter().map(|it| (it.page, it.slot)));
            }
        }
        reading.extend(
            self.retry
                .iter()
                .chain(&self.reconstruct)
                .map(|it| (it.page, it.slot)),
        );
        reading.extend(self.reads_done.iter().map(|d| (d.page, d.slot)));
        reading.extend(self.fetched.iter().copied());
        for (&page, &(_, _, slot)) in &self.moving {
            if !reading.contains(&(page, slot)) && !self.own_failed.contains(&page) {
                return Err(format!(
                    "page {page} is moving, but its read into slot {slot} is neither out, \
                     done nor failed"
                ));
            }
        }
        Ok(())
    }

    /// Every request not answered yet: (server, what it is for, whether it was sent).
    fn requests(&self) -> impl Iterator<Item = (usize, &Op, bool)> {
        let sent = self.inflight.ops.values().map(|(s, op)| (*s, op, true));
        let queued = self
            .queues
            .iter()
            .enumerate()
            .flat_map(|(s, q)| q.iter().map(move |q| (s, q.op(), false)));
        sent.chain(queued)
    }

    /// A waiting read waits for a count of its own GETs: the count is what is out.
    fn check_caller_reads(&self) -> Result<(), String> {
        let caller = |pos: usize| usize::from(crate::read::is_caller(pos));
        let mut out: usize = self
            .requests()
            .map(|(_, op, _)| match op {
                Op::Get(items) => items.iter().map(|it| caller(it.pos)).sum(),
                _ => 0,
            })
            .sum();
        out += self
            .retry
            .iter()
            .chain(&self.reconstruct)
            .map(|it| caller(it.pos))
            .sum::<usize>();
        out += self.reads_done.iter().map(|d| caller(d.pos)).sum::<usize>();
        if out != self.caller_reads {
            return Err(format!(
                "the waiting read counts {} of its reads out, {out} are",
                self.caller_reads
            ));
        }
        Ok(())
    }

    fn check_slots(&self) -> Result<(), String> {
        let nslots = self.dirty.len();
        let mut owner: Vec<Option<&'static str>> = vec![None; nslots];
        let mut claim = |slot: u32, by: &'static str| -> Result<(), String> {
            match owner.get_mut(slot as usize) {
                None => Err(format!(
                    "slot {slot} ({by}) is not a slot: there are {nslots}"
                )),
                Some(Some(first)) => Err(format!("slot {slot} is both {first} and {by}")),
                Some(o) => {
                    *o = Some(by);
                    Ok(())
                }
            }
        };
        for &s in &self.free_slots {
            claim(s, "free")?;
        }
        for (_, &s) in self.cache.iter() {
            claim(s, "cached")?;
        }
        for wb in self.writeback.values() {
            claim(wb.slot, "a write-back's data")?;
        }
        let mut puts = Vec::new();
        for (_, op, sent) in self.requests() {
            match op {
                Op::Get(items) => items.iter().try_for_each(|it| {
                    claim(
                        it.slot,
                        if sent {
                            "a GET in flight"
                        } else {
                            "a GET queued"
                        },
                    )
                })?,
                Op::Put(items) => puts.extend(items.iter().map(|it| (it.page, it.slot, it.kind))),
                _ => {}
            }
        }
        for it in self.retry.iter().chain(&self.reconstruct) {
            claim(it.slot, "a GET to try again")?;
        }
        // A degraded read by ticket waits for recovery (`reconstruct_later`): decoding it here
        // would wait.
        if let Some(it) = self
            .reconstruct
            .iter()
            .find(|it| crate::ticket::is_ticket(it.pos))
        {
            return Err(format!(
                "a read by ticket of page {} is to be decoded the waiting way",
                it.page
            ));
        }
        for d in &self.reads_done {
            claim(d.slot, "a finished read")?;
        }
        for &(_, s) in &self.fetched {
            claim(s, "recovery's read")?;
        }
        for f in &self.finished {
            if let Ok(crate::ticket::Data::Slot(s)) = f.data {
                claim(s, "a read by ticket, finished")?;
            }
        }
        let (mut owned, mut used) = (Vec::new(), Vec::new());
        self.scheme.slots_held(self, &mut owned, &mut used);
        for s in owned {
            claim(s, "the redundancy scheme's")?;
        }
        if let Some(s) = owner.iter().position(Option::is_none) {
            return Err(format!(
                "slot {s} is lost: neither free nor held by anything"
            ));
        }
        // Sealing (`seal.rs`): a write-back's slot holds ciphertext exactly when pages are
        // sealed; nothing else is marked as ciphertext to be opened on the way out.
        for (s, &sealed) in self.sealed.iter().enumerate() {
            let wb = owner[s] == Some("a write-back's data");
            if sealed != (wb && self.sealer.is_some()) {
                return Err(format!(
                    "slot {s} ({}) is {}sealed",
                    owner[s].unwrap_or("free"),
                    if sealed { "" } else { "not " }
                ));
            }
        }
        for &s in &used {
            if !matches!(
                owner[s as usize],
                Some("the redundancy scheme's" | "a write-back's data")
            ) {
                return Err(format!(
                    "a stripe write reads slot {s}, which is {}",
                    owner[s as usize].unwrap_or("free")
                ));
            }
        }
        for (page, slot, kind) in puts {
            let ok = match kind {
                PutKind::Piece(_) => used.contains(&slot),
                PutKind::Copy | PutKind::Parity(_) => {
                    self.writeback.get(&page).is_some_and(|wb| wb.slot == slot)
                }
            };
            if !ok {
                return Err(format!(
                    "a PUT of page {page} carries slot {slot}, which is {}",
                    owner[slot as usize].unwrap_or("free")
                ));
            }
        }
        if let Some((s, _)) = self
            .dirty
            .iter()
            .enumerate()
            .find(|&(s, &d)| d && owner[s] != Some("cached"))
        {
            return Err(format!(
                "slot {s} is dirty but {}",
                owner[s].unwrap_or("free")
            ));
        }
        Ok(())
    }

    fn check_credits(&self) -> Result<(), String> {
        let mut taken = vec![0u32; self.servers.len()];
        let mut largest = vec![0u32; self.servers.len()];
        for (id, (s, op)) in self.inflight.ops.iter() {
            let Some(t) = taken.get_mut(*s) else {
                return Err(format!(
                    "request {id} is in flight to server {s}, which is unknown"
                ));
            };
            *t += op.credits();
            largest[*s] = largest[*s].max(op.credits());
        }
        for (s, (&t, &held)) in taken.iter().zip(&self.inflight.per_server).enumerate() {
            if t != held {
                return Err(format!(
                    "server {s}: {held} credits taken, but its requests in flight hold {t}"
                ));
            }
            // A batch larger than a small server's window goes out alone (its frame is one
            // request to the server): the window bounds the rest.
            let w = self.window(s);
            if held > w + largest[s].saturating_sub(w) {
                return Err(format!(
                    "server {s}: {held} credits in flight, over its window of {w}"
                ));
            }
        }
        // The order of requests sent keeps answered ones only so long (`Inflight::compact`):
        // a pager driven by events alone must not grow without bound.
        let (order, ops) = (self.inflight.order.len(), self.inflight.ops.len());
        if order > 2 * ops + 65 {
            return Err(format!(
                "{order} requests remembered in sending order for {ops} in flight"
            ));
        }
        Ok(())
    }

    fn check_table(&self) -> Result<(), String> {
        let n = self.servers.len();
        for page in 0..self.cfg.pages {
            let holders = self.table.holders(page);
            if holders.iter().any(|s| s >= n) {
                return Err(format!("page {page}: a holder beyond the {n} servers"));
            }
            if holders.len() > self.shape.copies {
                return Err(format!(
                    "page {page}: {} holders, the scheme keeps {}",
                    holders.len(),
                    self.shape.copies
                ));
            }
            if !self.table.get(page).present && !holders.is_empty() {
                return Err(format!(
                    "page {page}: never written (or discarded) yet held"
                ));
            }
        }
        // Every PUT of a whole page, queued or in flight: (server, page, version).
        let mut carried = Vec::new();
        for (s, op, _) in self.requests() {
            if let Op::Put(items) = op {
                let whole = items
                    .iter()
                    .filter(|it| !matches!(it.kind, PutKind::Piece(_)));
                carried.extend(whole.map(|it| (s, it.page, it.version)));
            }
        }
        for (&page, wb) in &self.writeback {
            if !self.table.get(page).present {
                return Err(format!("page {page} is written back but not in the table"));
            }
            for s in wb.pending.iter() {
                if wb.done.contains(s) || wb.refused.contains(s) {
                    return Err(format!(
                        "page {page}: server {s} is both in flight and settled"
                    ));
                }
                if !carried.contains(&(s, page, wb.version)) {
                    return Err(format!(
                        "page {page}: a copy of version {} is pending at server {s}, but no \
                         PUT carries it there",
                        wb.version
                    ));
                }
            }
        }
        // Pages whose write the disk failed stay cached over the budget until written, and so
        // do the pages an eviction that would have waited left for a later call.
        if self.cache.len() > self.cfg.cache_pages + self.rehomed.len() + self.evictions_deferred {
            return Err(format!(
                "{} pages cached, over the budget of {}, the {} the disk failed and the {} \
                 whose eviction was deferred",
                self.cache.len(),
                self.cfg.cache_pages,
                self.rehomed.len(),
                self.evictions_deferred
            ));
        }
        if let Some(&page) = self
            .rehomed
            .iter()
            .find(|&p| self.cache.peek(p).is_none_or(|&s| !self.dirty[s as usize]))
        {
            return Err(format!(
                "page {page} waits to be written again but is not dirty in the cache"
            ));
        }
        let listed = self
            .scheme_state
            .get::<crate::scheme::mirror::Copies>()
            .into_iter()
            .flat_map(|c| c.listed());
        for page in listed {
            if page >= self.cfg.pages || !self.table.get(page).present {
                return Err(format!(
                    "recovery lists page {page}, which the table does not have"
                ));
            }
        }
        Ok(())
    }
}
