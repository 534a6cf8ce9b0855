//! Replies: how the world reaches the pager. [`Pager::on_reply`] takes one server's answer to
//! one request, [`Pager::on_failure`] a connection that failed or timed out; the pager's own
//! waits ([`Pager::poll`], and inside its operations) read replies from the transport and hand
//! them to the same code. Handling a reply never waits for another (`check_invariants` counts
//! any that does): what it starts is queued and sent as credits allow.
//!
//! A reply is checked against its request before anything is believed (paper 004 §IV-B: a
//! server may lie or be confused): a wrong key, version or checksum is a failed GET, a status
//! that does not fit the request declares the server dead.

use crate::requests::{GetItem, Inflight, Op, Part, PutItem, PutKind, Queued, ReadDone};
use crate::scheme::parity;
use crate::seal::Sealer;
use crate::{Disk, Pager, PagerCounters, PagerError, ServerState, Transport, TransportError};
use netram_proto::{DeleteStatus, ErrorCode, GetResult, PutStatus, Reply, PAGE_SIZE};

/// The fields a reply is read into, borrowed one by one: all disjoint from the transport,
/// whose receive buffer the reply may still borrow (a method taking `&mut self` could not).
macro_rules! inbox {
    ($pager:expr) => {
        Inbox {
            servers: &mut $pager.servers,
            inflight: &mut $pager.inflight,
            counters: &mut $pager.counters,
            slots: &mut $pager.slots,
            reads_done: &mut $pager.reads_done,
            followups: &mut $pager.followups,
            sealer: $pager.sealer.as_ref(),
        }
    };
}

impl<T: Transport, D: Disk> Pager<T, D> {
    pub(crate) fn recv_from(&mut self, server: usize) -> Result<(), PagerError> {
        self.receive(server, true).map(|_| ())
    }

    /// Handles the replies that have already arrived, from every server, without waiting for
    /// any, and sends what the credits they return allow: a program busy elsewhere (or a
    /// maintenance thread) lets write-backs finish and their slots come back between its
    /// operations. Returns how many replies it handled. A transport that cannot tell whether
    /// a reply is there handles none.
    pub fn poll(&mut self) -> Result<usize, PagerError> {
        self.poll_from(0..self.servers.len())
    }

    /// [`Pager::poll`] of some servers only: those whose descriptors a loop found readable
    /// (see [`Pager::reply_fds_by_server`]), so that it spends no system call on a connection
    /// with nothing to read.
    pub fn poll_from(
        &mut self,
        servers: impl IntoIterator<Item = usize>,
    ) -> Result<usize, PagerError> {
        let mut handled = 0;
        let mut result = Ok(());
        for server in servers {
            if server >= self.servers.len() {
                continue;
            }
            while self.inflight.per_server[server] > 0 {
                match self.receive(server, false) {
                    Ok(true) => handled += 1,
                    Ok(false) => break,
                    Err(e) => {
                        handled += 1;
                        result = Err(e);
                    }
                }
            }
        }
        self.start_slot_waiters(false);
        self.pump_all();
        result.map(|()| handled)
    }

    /// One server's answer to one request, from whatever owns the sockets: the pager matches
    /// it to its request, takes what it carries, and sends what the credits it returns allow.
    /// A reply that matches no request of that server declares the server dead (it is confused
    /// or lying), as does anything in it that does not fit the request. Never waits.
    pub fn on_reply(
        &mut self,
        server: usize,
        id: u64,
        reply: &Reply<'_>,
    ) -> Result<(), PagerError> {
        let accepted = inbox!(self).accept(server, id, reply);
        let handled = self.after_accept(server, accepted);
        self.start_slot_waiters(false);
        self.pump_all();
        handled
    }

    /// A connection that failed, or a server that did not answer in time
    /// ([`TransportError::Timeout`]): the server is declared dead and what was in flight to it
    /// fails over (writes go elsewhere, reads to another copy, the disk, or reconstruction).
    /// Never waits.
    pub fn on_failure(&mut self, server: usize, err: TransportError) {
        self.mark_dead(server, err);
        self.start_slot_waiters(false);
        self.pump_all();
    }

    /// Reads one reply from `server` and handles it: waiting for it, or only if it is there
    /// already (false when it is not).
    pub(crate) fn receive(&mut self, server: usize, wait: bool) -> Result<bool, PagerError> {
        let got = if wait {
            self.counters.waits += 1;
            Some(self.transport.recv(server))
        } else {
            self.transport.try_recv(server)
        };
        let accepted = match got {
            None => return Ok(false),
            Some(Err(e)) => Err(e),
            // The reply borrows the transport: the inbox is built from the other fields.
            Some(Ok((id, reply))) => inbox!(self).accept(server, id, &reply),
        };
        self.after_accept(server, accepted).map(|()| true)
    }

    /// What a reply set in motion, once it is no longer borrowed: the follow-ups its pages
    /// need (a failed GET tried elsewhere, a PUT's write-back settled), or, for a reply that
    /// made no sense or a failed connection, the server declared dead.
    fn after_accept(
        &mut self,
        server: usize,
        accepted: Result<(), TransportError>,
    ) -> Result<(), PagerError> {
        if let Err(e) = accepted {
            self.mark_dead(server, e);
            return Ok(());
        }
        // Taken out to be handled with `&mut self` (handling one never reads another reply:
        // `check_invariants` counts any wait); the buffer is put back to keep its capacity.
        let mut followups = std::mem::take(&mut self.followups);
        let mut result = Ok(());
        self.must_not_wait += 1;
        for f in followups.drain(..) {
            if let Err(e) = self.after_reply(server, f) {
                result = Err(e);
            }
        }
        self.must_not_wait -= 1;
        if self.followups.is_empty() {
            self.followups = followups;
        }
        result
    }
    pub(crate) fn after_reply(&mut self, server: usize, f: Followup) -> Result<(), PagerError> {
        match f {
            Followup::GetFailed(it, what) => self.get_failed(server, it, Some(what)),
            Followup::Stored(it) => self.stored(it, server)?,
            Followup::Replace(it) => {
                self.servers[server].load.free_pages = 0;
                self.put_failed(it, server)?;
            }
            Followup::Damaged(it) => self.put_failed(it, server)?,
            Followup::Parity(answer) => self.scheme_answer(server, answer)?,
            Followup::Expected(hand, status) => self.expected(*hand, status),
            Followup::Migrated(hand, status) => self.migrated(*hand, &status),
            Followup::Dead(why, op) => {
                self.mark_dead(server, TransportError::Protocol(why));
                if let Some(op) = op {
                    self.fail_op(server, op);
                }
            }
        }
        Ok(())
    }

    /// Marks a server dead and fails over everything queued for it and in flight to it.
    pub(crate) fn mark_dead(&mut self, server: usize, err: TransportError) {
        if self.servers[server].alive {
            tracing::warn!(server = %self.servers[server].info.name, "server marked dead: {err}");
            tracing::debug!(
                in_flight = self.inflight.per_server[server],
                ops = ?self.inflight.ops.iter().filter(|(_, (s, _))| *s == server).collect::<Vec<_>>(),
                "failing over"
            );
            self.counters.servers_dead += 1;
            self.servers[server].alive = false;
            self.servers[server].load.alive = false;
            self.servers[server].dead_reason = err.to_string();
            // Before its requests fail over (a parity pager rebuilds a read that failed there).
            self.server_lost(server);
        }
        let ids: Vec<u64> = self
            .inflight
            .ops
            .iter()
            .filter(|(_, (s, _))| *s == server)
            .map(|(&id, _)| id)
            .collect();
        let mut ops: Vec<Op> = Vec::new();
        for id in ids {
            let (_, op) = self.inflight.ops.remove(&id).expect("listed above");
            self.inflight.per_server[server] -= op.credits();
            ops.push(op);
        }
        // Their places in the sending order go too, as they do when replies come in.
        self.inflight.compact();
        self.dequeued[server] += self.queues[server].len() as u64;
        ops.extend(
            std::mem::take(&mut self.queues[server])
                .into_iter()
                .map(|q| match q {
                    Queued::Batch(op) | Queued::Frame { op, .. } => op,
                }),
        );
        for op in ops {
            self.fail_op(server, op);
        }
        self.server_failed_over(server);
    }

    /// An operation that will get no reply from `server`.
    pub(crate) fn fail_op(&mut self, server: usize, op: Op) {
        match op {
            Op::Get(items) => {
                for it in items {
                    self.get_failed(server, it, None);
                }
            }
            Op::Put(items) => {
                // The data is still in its slot: place the copy elsewhere.
                for it in items {
                    let placed = self.put_failed(it, server);
                    if let Err(e) = placed {
                        tracing::error!(
                            page = it.page,
                            "could not place page after server failure: {e}"
                        );
                    }
                }
            }
            Op::Delete | Op::Gc(_) | Op::Delta | Op::Scan => {}
            Op::Expect(hand) => self.handover_failed(*hand, false),
            Op::Migrate(hand) => self.handover_failed(*hand, true),
            Op::Ship(id) => {
                if let Err(e) = self.scheme_answer(server, parity::Answer::ShipFailed(id)) {
                    tracing::error!("could not place pages after a holder failed: {e}");
                }
            }
        }
    }
}

/// A reply's landing place: the pager's fields it writes, borrowed apart from the transport.
struct Inbox<'a> {
    servers: &'a mut [ServerState],
    inflight: &'a mut Inflight,
    counters: &'a mut PagerCounters,
    slots: &'a mut [u8],
    reads_done: &'a mut Vec<ReadDone>,
    followups: &'a mut Vec<Followup>,
    sealer: Option<&'a Sealer>,
}

impl Inbox<'_> {
    /// Matches a reply to its request and takes it in; an error when it answers no request of
    /// this server (the server is confused or lying).
    fn accept(&mut self, server: usize, id: u64, reply: &Reply<'_>) -> Result<(), TransportError> {
        let load = reply.load();
        self.servers[server].load.free_pages = load.free_pages;
        self.servers[server].load.requests_per_s = load.requests_per_s;
        if self.servers[server].leaving != load.leaving {
            self.servers[server].leaving = load.leaving;
            self.servers[server].leaving_changes += 1;
        }
        let Some((s, op)) = self.inflight.ops.remove(&id) else {
            return Err(TransportError::Protocol(format!(
                "reply to unknown request {id}"
            )));
        };
        if s != server {
            // Not ours to complete: put it back and drop this connection as confused.
            self.inflight.ops.insert(id, (s, op));
            return Err(TransportError::Protocol(format!(
                "reply to another server's request {id}"
            )));
        }
        self.inflight.per_server[s] -= op.credits();
        self.inflight.compact();
        self.complete(server, id, op, reply);
        Ok(())
    }

    /// Takes what a reply to `op` carries: pages into their slots, statuses into follow-ups.
    /// Anything that sends or reads the disk is queued as a [`Followup`] for
    /// [`Pager::after_reply`].
    fn complete(&mut self, server: usize, id: u64, op: Op, reply: &Reply<'_>) {
        let Inbox {
            counters,
            slots,
            reads_done,
            followups,
            sealer,
            ..
        } = self;
        match (op, reply) {
            (Op::Get(items), Reply::Get { pages, .. }) if pages.len() == items.len() => {
                for (it, got) in items.into_iter().zip(pages) {
                    let (page, slot) = (it.page, it.slot);
                    let dst =
                        &mut slots[slot as usize * PAGE_SIZE..(slot as usize + 1) * PAGE_SIZE];
                    // A page of this pager's own, sealed: it authenticates, or it is refused.
                    // Its crc32c adds nothing then (the tag is stronger) and is not checked.
                    // Pieces and survivors stay ciphertext, for their scheme's arithmetic.
                    let opener = sealer.filter(|_| it.part == Part::Page);
                    let what = match got {
                        GetResult::Found(p) if p.key != it.key => Some("wrong key"),
                        GetResult::Found(p) if opener.is_none() && !p.verify() => {
                            counters.checksum_failures += 1;
                            Some("checksum mismatch")
                        }
                        GetResult::Found(p) if p.version != it.version => {
                            counters.version_mismatches += 1;
                            Some("stale version")
                        }
                        GetResult::Found(p) if opener.is_some() && p.flags.is_zero() => {
                            // A sealed page is never all zeros on the wire.
                            counters.page_auth_failures += 1;
                            Some("authentication failed")
                        }
                        GetResult::Found(p)
                            if opener.is_some_and(|o| {
                                netram_proto::expand_into(p.data, dst);
                                !o.open(page, it.version, dst)
                            }) =>
                        {
                            counters.page_auth_failures += 1;
                            Some("authentication failed")
                        }
                        GetResult::Found(p) => {
                            if opener.is_none() {
                                // (Opened into its slot above otherwise.) A zero page and a
                                // page's zero tail travel as nothing.
                                netram_proto::expand_into(p.data, dst);
                            }
                            reads_done.push(ReadDone {
                                pos: it.pos,
                                page,
                                version: it.version,
                                slot,
                                part: it.part,
                            });
                            None
                        }
                        GetResult::Missing(_) => {
                            counters.missing_pages += 1;
                            Some("missing on server")
                        }
                    };
                    if let Some(what) = what {
                        // A missing page is what a server that dropped a clean copy says
                        // (`cluster+disk`): the disk has it, nothing is wrong. What it costs
                        // when no copy is left is reported where it is found lost.
                        if matches!(got, GetResult::Missing(_)) {
                            tracing::debug!(server, page, what, "page missing on server");
                        } else {
                            tracing::warn!(server, page, what, "bad page from server");
                        }
                        followups.push(Followup::GetFailed(it, what));
                    }
                }
            }
            (Op::Put(items), Reply::Put { status, .. }) if status.len() == items.len() => {
                for (it, st) in items.into_iter().zip(status) {
                    if let PutKind::Parity(_) = it.kind {
                        if let Some(answer) = parity::put_answer(it, *st) {
                            followups.push(Followup::Parity(answer));
                            continue;
                        }
                    }
                    followups.push(match st {
                        PutStatus::Stored => Followup::Stored(it),
                        PutStatus::Unprotected => Followup::Stored(it),
                        // Only a parity PUT involves a holder: said of any other, it is a lie
                        // (found by the simulator: a flipped status left a stripe's piece
                        // waiting forever).
                        PutStatus::HolderUnreachable => Followup::Dead(
                            "the server said a plain PUT's parity holder was unreachable".into(),
                            Some(Op::Put(vec![it])),
                        ),
                        PutStatus::Full => {
                            counters.puts_refused_full += 1;
                            Followup::Replace(it)
                        }
                        PutStatus::BadKey => Followup::Dead(
                            "the server refused a page key".into(),
                            Some(Op::Put(vec![it])),
                        ),
                        // Damaged on the way there: the slot still holds it intact. Placed
                        // again like a refused page (bounded: never to that server again for
                        // this write-back, so a server that always says so cannot loop us).
                        PutStatus::Corrupt => {
                            counters.puts_refused_corrupt += 1;
                            Followup::Damaged(it)
                        }
                    });
                }
            }
            (op @ (Op::Ship(_) | Op::Delta | Op::Scan | Op::Gc(_)), reply)
                if parity::answers(&op, reply) =>
            {
                if let Some(answer) = parity::answer(id, op, reply) {
                    followups.push(Followup::Parity(answer));
                }
            }
            (Op::Expect(hand), Reply::Move { status, .. }) if status.len() == hand.pages.len() => {
                followups.push(Followup::Expected(hand, status.clone()));
            }
            (Op::Migrate(hand), Reply::Move { status, .. }) if status.len() == hand.pages.len() => {
                followups.push(Followup::Migrated(hand, status.clone()));
            }
            (Op::Delete, Reply::Delete { status, .. }) => {
                debug_assert!(status.iter().all(|s| matches!(
                    s,
                    DeleteStatus::Deleted | DeleteStatus::Missing | DeleteStatus::HolderUnreachable
                )));
            }
            (op, Reply::Error { code, message, .. }) => {
                let why = match code {
                    ErrorCode::SessionExpired => format!("session expired: {message}"),
                    ErrorCode::ShuttingDown => format!("shutting down: {message}"),
                    ErrorCode::BadRequest => format!("request refused: {message}"),
                };
                followups.push(Followup::Dead(why, Some(op)));
            }
            (op, other) => {
                followups.push(Followup::Dead(
                    format!("reply {:?} does not match its request", other.kind()),
                    Some(op),
                ));
            }
        }
    }
}

/// What to do after a reply, once the transport's buffer is no longer borrowed.
#[derive(Debug)]
pub(crate) enum Followup {
    GetFailed(GetItem, &'static str),
    Stored(PutItem),
    Replace(PutItem),
    /// Not stored: damaged on the way (the server's checksum check failed).
    Damaged(PutItem),
    /// An answer only a parity pager's requests get.
    Parity(parity::Answer),
    /// A direct migration's EXPECT, and its MIGRATE, answered (`handover.rs`).
    Expected(Box<crate::handover::Hand>, Vec<netram_proto::MoveStatus>),
    Migrated(Box<crate::handover::Hand>, Vec<netram_proto::MoveStatus>),
    Dead(String, Option<Op>),
}
