//! Requests between a pager and its servers: what each is for ([`Op`]), the ones in flight and
//! the credits they hold (Anemone's per-server window, paper 001 §2.1), and the per-server
//! queues where requests wait, in the order they were made, for a full batch or for credits.
//!
//! Nothing here waits while a reply is being handled: a request without credits is queued and
//! goes out when replies return them (`pump`). Only the public operations wait, through
//! [`Pager::complete_one`], which reads one reply from the server of the oldest request in
//! flight.

use crate::scheme::parity::PutOp;
use crate::{Disk, Pager, PagerError, Transport, TransportError};
use netram_proto::{Page, PageFlags, PageKey, Request, PAGE_SIZE};
use std::collections::{HashMap, VecDeque};

/// One page of a batched GET: where its data goes. `pos` is the page's place in the caller's
/// buffer, [`INTERNAL`] for the pager's own reads (recovery), or a ticket's
/// (`ticket::TICKET` and its tag).
#[derive(Debug, Clone, Copy)]
pub(crate) struct GetItem {
    /// The page, or for a Reed-Solomon piece, its stripe.
    pub(crate) page: u64,
    pub(crate) slot: u32,
    pub(crate) pos: usize,
    /// What is asked for, and the version that must come back.
    pub(crate) key: PageKey,
    pub(crate) version: u32,
    pub(crate) part: Part,
}

/// What a GET reads, and so which scheme a failed one goes back to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Part {
    /// A page's current version (under Reed-Solomon, its stripe's data piece).
    Page,
    /// Piece `n` of a Reed-Solomon stripe, read by the pager itself.
    Piece(u8),
    /// A parity group's survivor or a page to protect again, read by parity recovery.
    Survivor,
}

/// The `pos` of the pager's own reads (recovery), which go to no caller's buffer.
pub(crate) const INTERNAL: usize = usize::MAX;

/// The `pos` of Reed-Solomon recovery's piece reads (`scheme/stripe/recover.rs`), which stay
/// out from one recovery step to the next: told apart from the pager's other own reads (a
/// degraded read's pieces of the same stripe, `rs_fetch`) so that neither takes the other's.
/// Bit 63 alone: neither `INTERNAL` nor a ticket's (bit 62) nor a caller's buffer position.
pub(crate) const RECOVERY: usize = 1 << 63;

/// One page of a batched PUT: its data is in `slot` until the server acknowledges it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PutItem {
    /// The page, or for a Reed-Solomon piece, its stripe.
    pub(crate) page: u64,
    pub(crate) slot: u32,
    pub(crate) version: u32,
    pub(crate) key: PageKey,
    pub(crate) kind: PutKind,
}

/// What a PUT stores, and so which scheme its answer goes back to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PutKind {
    /// One copy of a page (`none`, `mirror:N`).
    Copy,
    /// Piece `n` of a Reed-Solomon stripe.
    Piece(u8),
    /// A parity pager's page, with what it does to its group.
    Parity(PutOp),
}

/// A finished read, waiting to be copied out to its caller.
#[derive(Debug)]
pub(crate) struct ReadDone {
    pub(crate) pos: usize,
    pub(crate) page: u64,
    /// The version read.
    pub(crate) version: u32,
    pub(crate) slot: u32,
    pub(crate) part: Part,
}

/// What a request in flight is for. GETs and PUTs carry up to `batch_max` pages in one frame.
#[derive(Debug)]
pub(crate) enum Op {
    Get(Vec<GetItem>),
    Put(Vec<PutItem>),
    Delete,
    /// A parity pager's DELETE: keys the server could not delete (their holder could not be
    /// told) are tried again later.
    Gc(Vec<PageKey>),
    /// A parity page to its holder (the open group's id).
    Ship(u64),
    /// Deltas the owner sends itself (rebuilt members leaving their groups).
    Delta,
    Scan,
    /// A direct migration's EXPECT to the new server, and its MIGRATE to the old one.
    Expect(Box<crate::handover::Hand>),
    Migrate(Box<crate::handover::Hand>),
}

impl Op {
    /// A direct migration's request (`handover.rs`).
    pub(crate) fn is_handover(&self) -> bool {
        matches!(self, Op::Expect(_) | Op::Migrate(_))
    }

    /// A probe: an empty GET (`maintenance.rs`).
    pub(crate) fn is_probe(&self) -> bool {
        matches!(self, Op::Get(items) if items.is_empty())
    }

    /// Whether an operation that settles waits for this request: not for a direct
    /// migration's (its server answers once it has handed pages over, milliseconds, and
    /// they carry no data of ours), nor for a probe (it carries nothing; its server may be
    /// the one that hangs, which the probe's own timeout finds out).
    pub(crate) fn awaited(&self) -> bool {
        !self.is_handover() && !self.is_probe()
    }

    /// Credits the request takes from its server's window: one per page, and one for an
    /// empty GET (a probe), so that it is waited for like any request.
    pub(crate) fn credits(&self) -> u32 {
        match self {
            Op::Get(items) => items.len().max(1) as u32,
            Op::Put(items) => items.len() as u32,
            Op::Delete
            | Op::Gc(_)
            | Op::Ship(_)
            | Op::Delta
            | Op::Scan
            | Op::Expect(_)
            | Op::Migrate(_) => 1,
        }
    }
}

/// Requests in flight, by request id, and the credits (pages) they hold per server. Request ids
/// are ours, not a peer's, so a fast unkeyed hash is safe here.
#[derive(Debug, Default)]
pub(crate) struct Inflight {
    pub(crate) ops: HashMap<u64, (usize, Op), foldhash::fast::FixedState>,
    pub(crate) per_server: Vec<u32>,
    /// (request, server) in the order sent; answered ones are dropped lazily from the front.
    /// The oldest request still in flight names the server whose reply to wait for: the one
    /// most likely to be there already, so that every server's pipeline keeps moving.
    pub(crate) order: VecDeque<(u64, usize, u64)>,
    /// Requests sent so far: the third field of `order`, a request's place in sending order.
    pub(crate) sends: u64,
    /// (time in µs, `sends` then), taken by [`Inflight::late`] now and then: a request whose
    /// place is below a mark's was on the wire at the mark's time. Time comes only from the
    /// caller (the pager reads no clock), and a request's age is counted from the first mark
    /// after its sending: never more than it is.
    pub(crate) marks: VecDeque<(u64, u64)>,
}

impl Inflight {
    /// The server of the oldest request still in flight, other than a direct migration's
    /// (`handover.rs`) or a probe while there is any other: nothing waits for those (a server
    /// answers a handover only once it has handed the pages over, milliseconds; a probe's
    /// server may be the one that hangs, which the probe's own timeout finds out), while the
    /// oldest is what a wait is for.
    pub(crate) fn oldest(&mut self) -> Option<usize> {
        self.forget_answered();
        let mut handover = None;
        for &(id, server, _) in &self.order {
            match self.ops.get(&id) {
                Some((_, op)) if !op.awaited() => {
                    handover.get_or_insert(server);
                }
                Some(_) => return Some(server),
                None => {}
            }
        }
        handover
    }

    /// Forgets answered requests in `order` once they outnumber those in flight: a pager
    /// driven without waiting (reads by ticket, `on_reply`) never asks for the oldest, which
    /// is where they are otherwise dropped (a `netram run` of GNU sort grew by 16 bytes a
    /// request, 8 MiB in 16 s). Amortized O(1) a request.
    pub(crate) fn compact(&mut self) {
        if self.order.len() > 2 * self.ops.len() + 64 {
            let ops = &self.ops;
            self.order.retain(|(id, _, _)| ops.contains_key(id));
        }
    }

    fn forget_answered(&mut self) {
        while let Some(&(id, _, _)) = self.order.front() {
            if self.ops.contains_key(&id) {
                break;
            }
            self.order.pop_front();
        }
    }

    /// The servers with a request that an operation waits for (not a probe, which has its own
    /// timeout, nor a direct migration) on the wire for `timeout_us` or longer at `now_us`,
    /// which is also marked for later calls. One mark per sixteenth of the timeout at most, so
    /// that a caller may ask often; a request is found late between `timeout_us` and that much
    /// more after its sending, or after the first call following it.
    pub(crate) fn late(&mut self, now_us: u64, timeout_us: u64) -> Vec<usize> {
        if self
            .marks
            .back()
            .is_none_or(|&(t, _)| now_us.saturating_sub(t) >= (timeout_us / 16).max(1))
        {
            self.marks.push_back((now_us, self.sends));
        }
        // The newest mark at least `timeout_us` old is all that matters (and those after it).
        while self.marks.len() >= 2 && now_us.saturating_sub(self.marks[1].0) >= timeout_us {
            self.marks.pop_front();
        }
        let Some(&(t, before)) = self.marks.front() else {
            return Vec::new();
        };
        if now_us.saturating_sub(t) < timeout_us {
            return Vec::new();
        }
        self.forget_answered();
        let mut late = Vec::new();
        for &(id, server, place) in &self.order {
            if place >= before {
                break;
            }
            if self.ops.get(&id).is_some_and(|(_, op)| op.awaited()) && !late.contains(&server) {
                late.push(server);
            }
        }
        late
    }

    /// Whether anything is in flight that an operation waits for: anything but direct
    /// migrations and probes.
    pub(crate) fn any_awaited(&self) -> bool {
        self.ops.values().any(|(_, op)| op.awaited())
    }
}

/// See [`Pager::barrier`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Barrier {
    /// Per server, how many requests must have left its queue (what was queued at the
    /// barrier); `None` once they have.
    dequeued: Option<Vec<u64>>,
    /// Requests with a smaller id must be answered.
    id: u64,
}

/// A request waiting to be sent, in a per-server queue kept in the order the requests were
/// made: a connection applies its requests in order, so a DELETE of a superseded copy is never
/// overtaken by a later PUT of the same page. Requests wait there for their server's credits
/// (nothing blocks to get one) and GETs and PUTs for the batch they fill.
#[derive(Debug)]
pub(crate) enum Queued {
    /// GETs or PUTs filling one frame: built (PUTs sealed from their slots) when sent. A page
    /// joins the last open batch of its kind that no other request follows.
    Batch(Op),
    /// Any other request, encoded when it was made (its id is in the frame).
    Frame { id: u64, op: Op, frame: Vec<u8> },
}

impl Queued {
    pub(crate) fn op(&self) -> &Op {
        match self {
            Queued::Batch(op) | Queued::Frame { op, .. } => op,
        }
    }

    /// Whether it may go out now: a batch when full (or when everything must, `all`).
    pub(crate) fn ready(&self, batch_max: usize, all: bool) -> bool {
        let pages = match self {
            Queued::Frame { .. } => return true,
            Queued::Batch(Op::Get(items)) => items.len(),
            Queued::Batch(Op::Put(items)) => items.len(),
            Queued::Batch(_) => return true,
        };
        all || pages >= batch_max
    }
}

/// Adds a page to the last open batch of its kind (`items_of`) that no other request follows,
/// or to a new batch (`new`) at the tail; true when that batch is now full.
fn add_to_batch<I>(
    queue: &mut VecDeque<Queued>,
    batch_max: usize,
    item: I,
    items_of: impl Fn(&mut Op) -> Option<&mut Vec<I>>,
    new: impl FnOnce(Vec<I>) -> Op,
) -> bool {
    let open = queue
        .iter_mut()
        .rev()
        .map_while(|q| match q {
            Queued::Batch(op) => Some(op),
            Queued::Frame { .. } => None,
        })
        .find_map(|op| items_of(op).filter(|items| items.len() < batch_max));
    match open {
        Some(items) => {
            items.push(item);
            items.len() >= batch_max
        }
        None => {
            queue.push_back(Queued::Batch(new(vec![item])));
            batch_max == 1
        }
    }
}

impl<T: Transport, D: Disk> Pager<T, D> {
    /// Queues a GET on its server's open batch; a full batch goes out.
    pub(crate) fn submit_get_item(&mut self, server: usize, it: GetItem) {
        if self.add_get(server, it) {
            self.pump_paced(server);
        }
    }

    /// Puts a GET on its server's open batch (a dead server's fails over at once); true when
    /// that batch is now full.
    fn add_get(&mut self, server: usize, it: GetItem) -> bool {
        self.counters.gets += 1;
        if !self.servers[server].alive {
            self.get_failed(server, it, None);
            return false;
        }
        add_to_batch(
            &mut self.queues[server],
            self.cfg.batch_max,
            it,
            |op| match op {
                Op::Get(items) => Some(items),
                _ => None,
            },
            Op::Get,
        )
    }

    /// Queues a read by ticket's GET on its server's open batch; a full batch goes out if its
    /// server has credits. Never waits (unlike `submit_get_item` outside reply handling).
    pub(crate) fn queue_get(&mut self, server: usize, it: GetItem) {
        if self.add_get(server, it) {
            self.pump(server, false);
        }
    }

    /// Sends a server's full batches; outside reply handling, also waits for that server's
    /// replies until they have credits, as a pipeline should: a reader that filled a window
    /// takes its answers before asking more, rather than filling every free slot first.
    pub(crate) fn pump_paced(&mut self, server: usize) {
        self.pump(server, false);
        while self.must_not_wait == 0
            && self.servers[server].alive
            && self.queues[server]
                .front()
                .is_some_and(|q| q.ready(self.cfg.batch_max, false))
        {
            if let Err(e) = self.recv_from(server) {
                // Errors of other operations surface through their own completions.
                tracing::debug!("while waiting for a credit: {e}");
            }
            self.pump(server, false);
        }
    }

    /// Queues one page of a PUT on its server's open batch; true when the batch is full (the
    /// caller sends it once its own bookkeeping is done).
    pub(crate) fn queue_put(&mut self, server: usize, it: PutItem) -> bool {
        add_to_batch(
            &mut self.queues[server],
            self.cfg.batch_max,
            it,
            |op| match op {
                Op::Put(items) => Some(items),
                _ => None,
            },
            Op::Put,
        )
    }

    pub(crate) fn window(&self, s: usize) -> u32 {
        self.servers[s].info.window.min(self.cfg.window).max(1)
    }

    /// Nothing is in flight and nothing is waiting to be sent.
    pub(crate) fn idle(&self) -> bool {
        self.inflight.ops.is_empty() && self.queues.iter().all(VecDeque::is_empty)
    }

    /// A point in the stream of requests, for a step that must see what the servers have once
    /// everything sent or queued before it is answered (a parity scan), without waiting for it
    /// and without waiting for what is sent after it (a busy program never stops sending).
    pub(crate) fn barrier(&mut self) -> Barrier {
        self.pump_all();
        let queued = self.queues.iter().any(|q| !q.is_empty());
        Barrier {
            dequeued: queued.then(|| {
                self.queues
                    .iter()
                    .zip(&self.dequeued)
                    .map(|(q, &n)| n + q.len() as u64)
                    .collect()
            }),
            id: self.next_req,
        }
    }

    /// Whether everything queued or sent before `b` (but probes and direct migrations, which
    /// nothing waits for: [`Op::awaited`]) is answered or failed over.
    pub(crate) fn passed(&self, b: &mut Barrier) -> bool {
        if let Some(want) = &b.dequeued {
            if want.iter().zip(&self.dequeued).any(|(w, n)| n < w) {
                return false;
            }
            // What was queued then is on the wire now, under ids taken since.
            b.dequeued = None;
            b.id = self.next_req;
        }
        !self
            .inflight
            .ops
            .iter()
            .any(|(&id, (_, op))| id < b.id && op.awaited())
    }

    pub(crate) fn next_id(&mut self) -> u64 {
        let id = self.next_req;
        self.next_req += 1;
        id
    }

    /// Whether `server`'s window has room for an operation taking `credits` (a batch larger
    /// than a small server's whole window goes out alone).
    pub(crate) fn has_credits(&self, server: usize, credits: u32) -> bool {
        let window = self.window(server);
        self.inflight.per_server[server] + credits.min(window) <= window
    }

    /// Sends a request whose body does not borrow the slots: at once when nothing queued is
    /// ahead of it and its server has credits, else encoded into the server's queue. Never
    /// waits, so that it may be called while a reply is handled.
    /// Returns the request's id, `None` if its server is dead (the op failed over at once).
    pub(crate) fn submit(&mut self, server: usize, op: Op, req: &Request<'_>) -> Option<u64> {
        if !self.servers[server].alive {
            self.fail_op(server, op);
            return None;
        }
        let id = self.next_id();
        if self.queues[server].is_empty() && self.has_credits(server, op.credits()) {
            let sent = self.transport.send(server, id, req);
            self.sent(server, id, op, sent);
            return Some(id);
        }
        let mut frame = Vec::new();
        req.encode(id, &mut frame);
        self.queues[server].push_back(Queued::Frame { id, op, frame });
        Some(id)
    }

    /// Sends a server's queued requests, oldest first, while its window has credits: batches
    /// only when full unless `all` (before any wait, so that nothing waits on an unsent
    /// request). Never waits.
    pub(crate) fn pump(&mut self, server: usize, all: bool) {
        if !self.servers[server].alive {
            // Queued after `mark_dead` failed the rest over: fail these over too.
            self.dequeued[server] += self.queues[server].len() as u64;
            for q in std::mem::take(&mut self.queues[server]) {
                let (Queued::Batch(op) | Queued::Frame { op, .. }) = q;
                self.fail_op(server, op);
            }
            return;
        }
        while let Some(front) = self.queues[server].front() {
            if !self.servers[server].alive {
                // Died while sending (`mark_dead` failed the rest over).
                break;
            }
            if !front.ready(self.cfg.batch_max, all)
                || !self.has_credits(server, front.op().credits())
            {
                break;
            }
            self.dequeued[server] += 1;
            match self.queues[server].pop_front().expect("front") {
                Queued::Frame { id, op, frame } => {
                    let sent = self.transport.send_frame(server, &frame);
                    self.sent(server, id, op, sent);
                }
                Queued::Batch(op) => self.send_batch(server, op),
            }
        }
    }

    /// Sends one batch of GETs or PUTs as one frame.
    pub(crate) fn send_batch(&mut self, server: usize, op: Op) {
        let id = self.next_id();
        let sent = match &op {
            Op::Get(items) => {
                let keys = items.iter().map(|g| g.key).collect();
                self.transport.send(server, id, &Request::Get(keys))
            }
            Op::Put(items) => {
                // Sealed (checksummed) straight from the slots; the slots and the transport are
                // disjoint fields, so the pages are borrowed, not copied, until the frame is
                // encoded.
                let slots = &self.slots;
                // A whole copy of a page whose version is on the local disk too is a clean
                // page (GMS §4.5): a full server may drop it rather than refuse another
                // (`netram_store`'s `clean.rs`); a read then finds it missing and goes to the
                // disk. Not a stripe's or a parity group's piece: the others need it.
                let clean_copies =
                    self.cfg.backing == crate::Backing::ClusterDisk && self.shape.whole_copies;
                let table = &self.table;
                let seal = |it: &PutItem| {
                    let at = it.slot as usize * PAGE_SIZE;
                    let clean = clean_copies && it.kind == PutKind::Copy && {
                        let e = table.get(it.page);
                        e.on_disk && e.version == it.version
                    };
                    let flags = PageFlags(if clean { PageFlags::CLEAN } else { 0 });
                    Page::seal_with(it.key, it.version, flags, &slots[at..at + PAGE_SIZE])
                };
                let req = if items.iter().all(|it| it.kind == PutKind::Copy) {
                    Request::Put(items.iter().map(seal).collect())
                } else {
                    let addrs = |h: u16| self.servers[usize::from(h)].info.addr.expect("checked");
                    Request::PutParity(
                        items
                            .iter()
                            .map(|it| {
                                let op = match it.kind {
                                    PutKind::Parity(PutOp::Join { group, holder }) => {
                                        netram_proto::ParityOp::Join {
                                            holder: addrs(holder),
                                            holder_node: self.servers[usize::from(holder)]
                                                .info
                                                .node,
                                            group,
                                            member: addrs(server as u16),
                                        }
                                    }
                                    _ => netram_proto::ParityOp::Keep,
                                };
                                (seal(it), op)
                            })
                            .collect(),
                    )
                };
                self.transport.send(server, id, &req)
            }
            other => unreachable!("only GETs and PUTs are batched, not {other:?}"),
        };
        self.sent(server, id, op, sent);
    }

    /// Sends whatever queued request the servers' credits allow, full batches or not. Never
    /// waits: what finds no credit goes out as replies return them.
    pub(crate) fn pump_all(&mut self) {
        for s in 0..self.queues.len() {
            self.pump(s, true);
        }
    }

    /// Waits until every queued request is on the wire (not answered): a public operation
    /// that does not wait for its writes still leaves nothing behind unsent.
    pub(crate) fn send_everything(&mut self) -> Result<(), PagerError> {
        self.pump_all();
        while self.queues.iter().any(|q| !q.is_empty()) {
            self.complete_one()?;
        }
        Ok(())
    }

    pub(crate) fn sent(
        &mut self,
        server: usize,
        id: u64,
        op: Op,
        sent: Result<(), TransportError>,
    ) {
        match sent {
            Ok(()) => {
                self.inflight.per_server[server] += op.credits();
                self.inflight.ops.insert(id, (server, op));
                let place = self.inflight.sends;
                self.inflight.sends += 1;
                self.inflight.order.push_back((id, server, place));
                self.inflight.compact();
            }
            Err(e) => {
                self.mark_dead(server, e);
                self.fail_op(server, op);
            }
        }
    }

    /// Sends what is queued, then waits for one reply from the server whose request has waited
    /// longest (the oldest in flight), so that every server's pipeline keeps moving.
    /// Returns without waiting when nothing is in flight (everything queued failed over).
    pub(crate) fn complete_one(&mut self) -> Result<(), PagerError> {
        if self.must_not_wait > 0 {
            self.forbidden_waits += 1;
        }
        self.pump_all();
        match self.inflight.oldest() {
            Some(server) => self.recv_from(server),
            None => Ok(()),
        }
    }

    /// Completes everything queued and in flight but direct migrations and probes, which go
    /// on (see [`Op::awaited`]).
    pub(crate) fn settle(&mut self) -> Result<(), PagerError> {
        while !self.settled() {
            self.complete_one()?;
        }
        Ok(())
    }

    /// Whether nothing but direct migrations and probes is queued or in flight.
    pub(crate) fn settled(&self) -> bool {
        !self.inflight.any_awaited()
            && self.queues.iter().flatten().all(|q| match q {
                Queued::Frame { op, .. } => !op.awaited(),
                Queued::Batch(_) => false,
            })
    }

    /// Whether request `id` to `server` is still queued or in flight.
    pub(crate) fn pending(&self, server: usize, id: u64) -> bool {
        self.inflight.ops.contains_key(&id)
            || self.queues[server]
                .iter()
                .any(|q| matches!(q, Queued::Frame { id: i, .. } if *i == id))
    }

    /// Completes everything queued and in flight.
    pub(crate) fn drain(&mut self) -> Result<(), PagerError> {
        while !self.idle() {
            self.complete_one()?;
        }
        Ok(())
    }
}
