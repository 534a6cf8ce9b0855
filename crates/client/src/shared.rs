//! A pager shared by several threads, none holding it across a round trip (Anemone §2.2:
//! each request is served as its own, and the pipeline, not a lock held per request, hides the
//! round trips). The NBD device's connections read and write through it, and so does any
//! program that reads and writes pages by number from several threads (the C ABI's users,
//! `netram bench adapt`'s paging client); a maintenance thread ([`crate::maintain`]) takes the
//! same lock for its ticks.
//!
//! A read takes the pager's lock, copies out what needs no I/O (cache and write-back hits,
//! pages never written), starts reads by ticket for the misses (`netram_pager`'s `ticket.rs`)
//! and lets the lock go. Then it waits on the connections to the page servers, without the
//! lock; whichever waiting read takes the lock next reads every reply that has come in and
//! copies each finished page into the buffer of the read it belongs to (its ticket's tag
//! names the read and the page's place in it). So a read of a cached page on one connection
//! never waits for another connection's round trip, and the misses of all connections travel
//! in the same batches.
//!
//! Writes of whole pages go into the pager's cache under the lock, the pages they evict
//! queued for write-back and sent as credits allow, nothing waited for
//! (`Pager::try_write_many`); only when no slot is free does a write let the lock go and wait
//! for acknowledgements the same way. Discards (TRIM, pages written all zeros) wait so for a
//! page's write-back in flight. A FLUSH writes back the pages dirty when it came (a write
//! with FUA: its own pages) as slots allow, seals what the scheme keeps open and waits for
//! the acknowledgements without the lock (`Pager::try_flush`). A partial page's read and its
//! write must not let another connection's write of the same page in between, so they are in
//! one hold of the lock (`device.rs`), the page read into the cache by ticket beforehand and
//! the write taken into the cache as a whole page's is.

use netram_pager::{Disk, Pager, PagerError, Transport};
use netram_proto::PAGE_SIZE;
use rustix::event::{eventfd, poll, EventfdFlags, PollFd, PollFlags, Timespec};
use std::collections::HashMap;
use std::future::Future;
use std::os::fd::{BorrowedFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

/// Bits of a ticket's tag that give the page's place in its read; the rest name the read.
/// A read is at most a pipeline batch (16 MiB: 4,096 pages), far below this.
const PLACE_BITS: u32 = 24;

/// How long a waiting read sleeps before it looks again without a wake-up: a reply may wait
/// in a connection's buffer, read off the socket with another by a holder of the lock that
/// waited for one only. (A reply another holder took in for this read wakes it: [`WAKE`].)
const NAP: Duration = Duration::from_millis(5);

thread_local! {
    /// This thread's wake-up: an eventfd that another holder of the lock (the maintenance
    /// thread's tick, another connection's write) writes to when it takes in the last page of
    /// a read this thread waits for, so that the read does not sleep until [`NAP`] (it did:
    /// the owner's read p99 during a migration was 3 ms in `netram bench adapt`). Held by
    /// `Arc` in the read too, so that it stays open as long as anyone may write to it.
    static WAKE: Option<Arc<OwnedFd>> =
        eventfd(0, EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC).ok().map(Arc::new);
}

fn my_wake() -> Option<Arc<OwnedFd>> {
    WAKE.with(Clone::clone)
}

/// Wakes the thread whose [`WAKE`] `w` is. A failed write (the counter full, which 2^64
/// wake-ups unread would take) leaves it to [`NAP`].
fn wake(w: &OwnedFd) {
    let _ = rustix::io::write(w, &1u64.to_ne_bytes());
}

/// The pager and the reads by ticket of every connection, behind the device's one lock.
struct Inner<T: Transport, D: Disk> {
    pager: Pager<T, D>,
    reads: HashMap<u64, Reading>,
    next: u64,
    /// The waiting read whose thread watches the page servers' connections; the others sleep
    /// on their own wake-up ([`WAKE`]) until a holder of the lock completes their read or
    /// hands them this role. One thread woken per reply, not one per waiting read: with four
    /// connections' reads waiting, each reply woke four threads, which then queued for the
    /// lock (leader and followers, as in Schmidt's pattern).
    leader: Option<u64>,
    /// Operations of an event loop waiting for any progress (a slot, a credit, an
    /// acknowledgement: [`SharedPager::drive_async`]), woken whenever replies are taken in.
    progress: Vec<Waker>,
}

/// One caller's read in flight: where its pages go and how many are still out.
struct Reading {
    /// The pages still to be started, in order, with their places in `out`.
    pages: Vec<(u64, usize)>,
    started: usize,
    out: Vec<u8>,
    left: usize,
    failed: Option<PagerError>,
    /// Its thread's wake-up ([`WAKE`]), for a thread that waits.
    wake: Option<Arc<OwnedFd>>,
    /// Its task's, for a read of an event loop ([`SharedPager::read_pages_async`]).
    waker: Option<Waker>,
}

impl<T: Transport, D: Disk> Inner<T, D> {
    fn new(pager: Pager<T, D>) -> Self {
        Self {
            pager,
            reads: HashMap::new(),
            next: 0,
            leader: None,
            progress: Vec::new(),
        }
    }

    /// Wakes the event loop's operations waiting for progress (see `progress`).
    fn wake_progress(&mut self) {
        for w in self.progress.drain(..) {
            w.wake();
        }
    }

    /// Hands every finished read by ticket to the read it belongs to. A page whose read was
    /// given up on (its caller failed early) is dropped.
    fn route(&mut self) {
        let Self { pager, reads, .. } = self;
        let mine = my_wake();
        let taken = pager.take_finished(|tag, _page, data| {
            let Some(r) = reads.get_mut(&(tag >> PLACE_BITS)) else {
                return;
            };
            let place = (tag & ((1 << PLACE_BITS) - 1)) as usize;
            r.left -= 1;
            match data {
                Ok(d) => r.out[place * PAGE_SIZE..(place + 1) * PAGE_SIZE].copy_from_slice(d),
                Err(e) => {
                    r.failed.get_or_insert(e);
                }
            }
            if r.left == 0 {
                if let Some(w) = r.waker.take() {
                    w.wake();
                }
            }
            match &r.wake {
                Some(w) if r.left == 0 && !mine.as_ref().is_some_and(|m| Arc::ptr_eq(m, w)) => {
                    // Another thread's read is complete: it is woken.
                    wake(w);
                }
                _ => {}
            }
        });
        if let Err(e) = taken {
            // Keeping a finished page in the cache evicted another whose write-back failed:
            // the pager keeps it and reports it to the next write or flush.
            tracing::debug!("after a read by ticket: {e}");
        }
        // What keeping the pages evicted goes out now, not at the next reply.
        pager.send_queued();
    }

    /// When the reading thread that watched the connections leaves with no one in its role:
    /// another waiting read's thread is woken to take it.
    fn hand_lead(&self, from: u64) {
        if self.leader.is_some() {
            return;
        }
        let next = self
            .reads
            .iter()
            .find(|&(&id, r)| id != from && r.left > 0 && r.wake.is_some());
        if let Some((_, r)) = next {
            let w = r.wake.as_ref().expect("filtered above");
            wake(w);
        }
    }

    /// Starts as many of read `id`'s pages as the pager has slots for without waiting (one
    /// even without, when nothing in flight could free one: then `start_read` makes room by
    /// evicting, which needs no reply).
    fn start(&mut self, id: u64) -> Result<(), PagerError> {
        let r = self.reads.get_mut(&id).expect("a read in flight");
        while r.started < r.pages.len() {
            if self.pager.read_room() == 0 && self.pager.awaits_replies() {
                break;
            }
            let (page, place) = r.pages[r.started];
            self.pager
                .start_read(page, (id << PLACE_BITS) | place as u64)?;
            r.started += 1;
        }
        self.pager.send_queued();
        Ok(())
    }
}

/// A pager behind one lock, for threads that read and write pages by number: none holds the
/// lock across a round trip (see the module's documentation).
pub struct SharedPager<T: Transport, D: Disk> {
    lock: Mutex<Inner<T, D>>,
    /// Reads and writes under way (see [`SharedPager::busy`]).
    busy: AtomicUsize,
}

impl<T: Transport, D: Disk> std::fmt::Debug for SharedPager<T, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedPager").finish_non_exhaustive()
    }
}

/// The pager under the lock, for a step that does not wait (a tick, a counter, a setting).
/// When it is let go, the reads by ticket that the step finished (a tick takes in every reply
/// that has come) go to the reads they belong to, and a read made complete wakes its thread.
pub struct Locked<'a, T: Transport, D: Disk>(MutexGuard<'a, Inner<T, D>>);

impl<T: Transport, D: Disk> Drop for Locked<'_, T, D> {
    fn drop(&mut self) {
        if !self.0.reads.is_empty() && self.0.pager.has_finished() {
            self.0.route();
        }
        // (Operations of an event loop waiting for progress are not woken here: each step of
        // theirs holds the lock too, and two of them would wake each other for ever. The
        // loop looks at the servers' connections again after its nap.)
    }
}

impl<T: Transport, D: Disk> std::fmt::Debug for Locked<'_, T, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Locked").finish_non_exhaustive()
    }
}

impl<T: Transport, D: Disk> std::ops::Deref for Locked<'_, T, D> {
    type Target = Pager<T, D>;
    fn deref(&self) -> &Pager<T, D> {
        &self.0.pager
    }
}

impl<T: Transport, D: Disk> std::ops::DerefMut for Locked<'_, T, D> {
    fn deref_mut(&mut self) -> &mut Pager<T, D> {
        &mut self.0.pager
    }
}

impl<T: Transport, D: Disk> SharedPager<T, D> {
    pub fn new(pager: Pager<T, D>) -> Self {
        Self {
            lock: Mutex::new(Inner::new(pager)),
            busy: AtomicUsize::new(0),
        }
    }

    /// The pager, under the lock. An operation that waits for replies (`Pager::read_many`,
    /// `Pager::write_many`) run through it holds every other thread off until its replies
    /// are in: use the methods below instead.
    pub fn lock(&self) -> Locked<'_, T, D> {
        guard(&self.lock)
    }

    pub fn into_pager(self) -> Pager<T, D> {
        self.lock
            .into_inner()
            .unwrap_or_else(|p| p.into_inner())
            .pager
    }

    /// Reads `pages` into `out` (resized to PAGE_SIZE bytes each), holding the lock only while
    /// the reads start and while replies are taken in.
    pub fn read_pages(&self, pages: &[u64], out: &mut Vec<u8>) -> Result<(), PagerError> {
        let _busy = Busy::new(&self.busy);
        read_pages(&self.lock, pages, out)
    }

    /// Whether a read, write, discard or flush is under way. Each takes in the replies that
    /// come while it waits, whoever they are for (a move's, recovery's), and sends what they
    /// let go: a maintenance thread then need not wake for replies too, and race it for them
    /// (`crate::maintain::spawn_beside`).
    pub fn busy(&self) -> bool {
        self.busy.load(Ordering::Relaxed) > 0
    }

    /// Writes whole pages (PAGE_SIZE bytes each of `data`), in order, into the pager's cache;
    /// the pages they evict leave as credits allow. Waits, without the lock, only for a slot.
    pub fn write_pages(&self, pages: &[u64], data: &[u8]) -> Result<(), PagerError> {
        let _busy = Busy::new(&self.busy);
        write_pages(&self.lock, pages, data)
    }

    /// Discards `pages` (`Pager::discard_many`), without the lock while a page's last
    /// write-back is in flight.
    pub fn discard_pages(&self, pages: &[u64]) -> Result<(), PagerError> {
        let _busy = Busy::new(&self.busy);
        discard_pages(&self.lock, pages)
    }

    /// Writes back the dirty pages (only those of `only`, if given) and waits for their
    /// acknowledgements, without the lock between steps.
    pub fn flush(&self, only: Option<&[u64]>) -> Result<(), PagerError> {
        let _busy = Busy::new(&self.busy);
        flush(&self.lock, only)
    }

    /// Runs an operation in steps that do not wait (see [`drive`]): `step(pager, false)`
    /// until it returns true, with the lock let go while replies come in; `step(pager, true)`
    /// may wait, and is called only when nothing in flight could move the operation on.
    pub fn drive(
        &self,
        what: &str,
        step: impl FnMut(&mut Pager<T, D>, bool) -> Result<bool, PagerError>,
    ) -> Result<(), PagerError> {
        let _busy = Busy::new(&self.busy);
        drive(&self.lock, what, step)
    }
}

/// One operation of [`SharedPager::busy`], for as long as it lives.
#[derive(Debug)]
pub struct Busy<'a>(&'a AtomicUsize);

impl<'a> Busy<'a> {
    fn new(n: &'a AtomicUsize) -> Self {
        n.fetch_add(1, Ordering::Relaxed);
        Self(n)
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The lock. A panic while holding it is a bug in the pager; the data it guards would
/// be as broken after it as before, so carrying on is no worse.
fn guard<T: Transport, D: Disk>(lock: &Mutex<Inner<T, D>>) -> Locked<'_, T, D> {
    Locked(lock.lock().unwrap_or_else(|p| p.into_inner()))
}

/// Reads `pages` into `out` (PAGE_SIZE bytes each) through the pager behind `lock`, holding
/// the lock only while it starts reads and takes in replies.
fn read_pages<T: Transport, D: Disk>(
    lock: &Mutex<Inner<T, D>>,
    pages: &[u64],
    out: &mut Vec<u8>,
) -> Result<(), PagerError> {
    let id = {
        let mut locked = guard(lock);
        match begin_read(&mut locked.0, pages, out, my_wake())? {
            Some(id) => id,
            None => return Ok(()),
        }
    };
    let result = wait(lock, id);
    let r = guard(lock).0.reads.remove(&id).expect("a read in flight");
    *out = r.out;
    // Its tickets still out, if it failed early, finish into nothing (see `Inner::route`).
    result.and(r.failed.map_or(Ok(()), Err))
}

/// Copies into `out` what of `pages` needs no I/O and registers the misses as a read by
/// ticket, woken through `wake` if given (`None`: no miss, the read is done). Shared by the
/// blocking read and the event loop's [`ReadPages`].
fn begin_read<T: Transport, D: Disk>(
    inner: &mut Inner<T, D>,
    pages: &[u64],
    out: &mut Vec<u8>,
    wake: Option<Arc<OwnedFd>>,
) -> Result<Option<u64>, PagerError> {
    out.resize(pages.len() * PAGE_SIZE, 0);
    let mut misses = Vec::new();
    for (place, &page) in pages.iter().enumerate() {
        let dst = &mut out[place * PAGE_SIZE..(place + 1) * PAGE_SIZE];
        if !inner.pager.read_at_hand(page, dst)? {
            misses.push((page, place));
        }
    }
    if misses.is_empty() {
        return Ok(None);
    }
    let id = inner.next;
    inner.next = (inner.next + 1) % (1 << (62 - PLACE_BITS));
    let left = misses.len();
    inner.reads.insert(
        id,
        Reading {
            pages: misses,
            started: 0,
            out: std::mem::take(out),
            left,
            failed: None,
            wake,
            waker: None,
        },
    );
    Ok(Some(id))
}

/// Moves read `id` on until every page of it has finished.
fn wait<T: Transport, D: Disk>(lock: &Mutex<Inner<T, D>>, id: u64) -> Result<(), PagerError> {
    let mut fds: Vec<(usize, RawFd)> = Vec::new();
    let mut readable: Vec<usize> = Vec::new();
    loop {
        let lead;
        {
            let mut locked = guard(lock);
            let inner = &mut *locked.0;
            // The role of watching the connections is taken again at each round, by whoever
            // finds it free (see `Inner::leader`).
            if inner.leader == Some(id) {
                inner.leader = None;
            }
            // Only the connections poll found readable are read: one recv each, none spent
            // on a server whose reply has not come (the first round, for reads not started
            // yet, reads none). A reply another holder of the lock read off a socket is among
            // the pager's finished reads already.
            if let Err(e) = inner.pager.poll_from(readable.drain(..)) {
                tracing::debug!("while reading: {e}");
            }
            inner.route();
            inner.start(id)?;
            let r = &inner.reads[&id];
            if r.left == 0 {
                inner.hand_lead(id);
                return Ok(());
            }
            let no_wake = r.wake.is_none();
            fds.clear();
            inner.pager.reply_fds_by_server(&mut fds);
            // Nothing to wait on (a transport in memory, or only degraded reads left, which
            // the next take decodes): waited for under the lock, as every read was before.
            if fds.is_empty() {
                inner.pager.wait_finished()?;
                continue;
            }
            // A server that hangs is failed by the pager's reply timeout, and the reads it
            // held go to another copy, without waiting for it under the lock.
            inner.pager.expire(netram_pager::real_time_us());
            // Without a wake-up of its own (no eventfd to be had) a read watches the
            // connections itself, as every read did before.
            lead = inner.leader.is_none() || no_wake;
            if lead && !no_wake {
                inner.leader = Some(id);
            }
        }
        if lead {
            nap(&fds, &mut readable);
        } else {
            // Woken when its read is complete or the role is handed over, or after NAP.
            nap(&[], &mut readable);
        }
    }
}

/// What `poll` waits on for the connections in `fds`.
fn poll_fds(fds: &[(usize, RawFd)]) -> Vec<PollFd<'static>> {
    fds.iter()
        .map(|&(_, fd)| {
            // SAFETY: a connection of the pager's transport, only looked at by poll. One closed
            // or reused meanwhile (a reconnection by another holder of the lock, when the lock
            // is not held) is at worst a spurious wake-up: the replies are read through the
            // pager, under the lock, by its current connections.
            PollFd::from_borrowed_fd(unsafe { BorrowedFd::borrow_raw(fd) }, PollFlags::IN)
        })
        .collect()
}

/// Sleeps until a connection in `fds` (with its server) is readable, this thread is woken
/// ([`WAKE`]) or [`NAP`] has passed, and adds the servers to read to `readable`.
fn nap(fds: &[(usize, RawFd)], readable: &mut Vec<usize>) {
    let wake = my_wake();
    let mut polled = poll_fds(fds);
    if let Some(w) = &wake {
        polled.push(PollFd::new(&**w, PollFlags::IN));
    }
    let nap = Timespec {
        tv_sec: 0,
        tv_nsec: NAP.as_nanos() as i64,
    };
    match poll(&mut polled, Some(&nap)) {
        Ok(0) => {
            // Nothing readable for a while: a reply may wait in a connection's buffer, read
            // off the socket with another by a holder of the lock that waited for one only (a
            // partial page's read-modify-write, a FLUSH). Every connection is looked at.
            readable.extend(fds.iter().map(|&(s, _)| s));
        }
        Ok(_) => {
            if let Some(w) = &wake {
                if polled.last().is_some_and(|p| !p.revents().is_empty()) {
                    // Taken: the next wake-up is for a later read of this thread.
                    let mut count = [0u8; 8];
                    let _ = rustix::io::read(&**w, &mut count);
                }
            }
            readable.extend(
                polled
                    .iter()
                    .zip(fds)
                    .filter(|(p, _)| !p.revents().is_empty())
                    .map(|(_, &(s, _))| s),
            )
        }
        Err(rustix::io::Errno::INTR) => {}
        Err(e) => tracing::debug!("poll while waiting for replies: {e}"),
    }
}

/// Takes in, without waiting, the replies that have come: the credits and slots they return
/// let a write go on. One `poll` on the connections with requests in flight, then a read of
/// each readable one.
fn take_in<T: Transport, D: Disk>(pager: &mut Pager<T, D>) {
    let mut fds = Vec::new();
    pager.reply_fds_by_server(&mut fds);
    if fds.is_empty() {
        return;
    }
    let mut polled = poll_fds(&fds);
    let zero = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    if !matches!(poll(&mut polled, Some(&zero)), Ok(n) if n > 0) {
        return;
    }
    let readable: Vec<usize> = polled
        .iter()
        .zip(&fds)
        .filter(|(p, _)| !p.revents().is_empty())
        .map(|(_, &(s, _))| s)
        .collect();
    if let Err(e) = pager.poll_from(readable) {
        tracing::debug!("while taking in replies: {e}");
    }
}

/// Runs an operation on the pager behind `lock` in steps, each under the lock and none
/// waiting (`step(pager, false)`, true once the operation is done), letting the lock go
/// between them while replies come in. When nothing is in flight that could let it go on (a
/// victim's page waits in a stripe or group not sealed yet), one step is done the waiting way
/// instead (`step(pager, true)`), as every operation was before. A server that hangs is failed
/// by the pager's reply timeout (`Pager::expire`), and what it held goes elsewhere.
fn drive<T: Transport, D: Disk>(
    lock: &Mutex<Inner<T, D>>,
    what: &str,
    mut step: impl FnMut(&mut Pager<T, D>, bool) -> Result<bool, PagerError>,
) -> Result<(), PagerError> {
    let mut fds: Vec<(usize, RawFd)> = Vec::new();
    let mut readable: Vec<usize> = Vec::new();
    let mut first = true;
    loop {
        {
            let mut inner = guard(lock);
            if std::mem::take(&mut first) {
                // Acknowledgements that came since the last operation return credits, so
                // that requests queued behind them go now (none queued: they wait until an
                // operation runs out of room, one `poll` each saved).
                if inner.sends_waiting() {
                    take_in(&mut inner);
                }
            } else if let Err(e) = inner.poll_from(readable.drain(..)) {
                tracing::debug!("while {what}: {e}");
            }
            if step(&mut *inner, false)? {
                return Ok(());
            }
            fds.clear();
            inner.reply_fds_by_server(&mut fds);
            if fds.is_empty() {
                if step(&mut *inner, true)? {
                    return Ok(());
                }
                continue;
            }
            inner.expire(netram_pager::real_time_us());
        }
        nap(&fds, &mut readable);
    }
}

/// The step of a write of `pages` from `data` (PAGE_SIZE bytes each), in order, for
/// [`drive`]: the pager takes what it has room for without waiting (`Pager::try_write_many`:
/// into the cache, evicted pages queued for write-back); with no slot free the operation lets
/// the lock go while replies come in.
fn write_step<'a, T: Transport, D: Disk>(
    pages: &'a [u64],
    data: &'a [u8],
) -> impl FnMut(&mut Pager<T, D>, bool) -> Result<bool, PagerError> + 'a {
    let mut done = 0;
    move |pager, wait| {
        let n = if wait {
            let at = done * PAGE_SIZE;
            pager.write_many(&pages[done..done + 1], &data[at..at + PAGE_SIZE])?;
            1
        } else {
            pager.try_write_many(&pages[done..], &data[done * PAGE_SIZE..])?
        };
        done += n;
        Ok(done == pages.len())
    }
}

/// The step of a discard of `pages` (see `Pager::discard_many`) for [`drive`]: a page whose
/// last write-back, which a discard must not overtake, is in flight lets the lock go until it
/// is acknowledged.
fn discard_step<'a, T: Transport, D: Disk>(
    pages: &'a [u64],
) -> impl FnMut(&mut Pager<T, D>, bool) -> Result<bool, PagerError> + 'a {
    let mut done = 0;
    move |pager, wait| {
        if wait {
            pager.discard_many(&pages[done..done + 1])?;
            done += 1;
        }
        while done < pages.len() && pager.try_discard(pages[done])? {
            done += 1;
        }
        pager.send_queued();
        Ok(done == pages.len())
    }
}

/// The step of a flush for [`drive`]: writes back every page dirty in the pager's cache now
/// (or only those of `only`: a write with FUA), seals what its scheme keeps open and ends when
/// the acknowledgements are in (`Pager::try_flush`). When nothing is in flight that could move
/// it on, the whole cache is flushed the waiting way, which covers the pages of `only` too.
fn flush_step<T: Transport, D: Disk>(
    pager: &Pager<T, D>,
    only: Option<&[u64]>,
) -> impl FnMut(&mut Pager<T, D>, bool) -> Result<bool, PagerError> {
    let mut flush = match only {
        Some(pages) => pager.start_flush_of(pages),
        None => pager.start_flush(),
    };
    move |pager, wait| {
        if wait {
            pager.flush()?;
            return Ok(true);
        }
        pager.try_flush(&mut flush)
    }
}

/// Writes `pages` from `data` through the pager behind `lock` ([`write_step`]).
fn write_pages<T: Transport, D: Disk>(
    lock: &Mutex<Inner<T, D>>,
    pages: &[u64],
    data: &[u8],
) -> Result<(), PagerError> {
    drive(lock, "writing", write_step(pages, data))
}

/// Discards `pages` through the pager behind `lock` ([`discard_step`]).
fn discard_pages<T: Transport, D: Disk>(
    lock: &Mutex<Inner<T, D>>,
    pages: &[u64],
) -> Result<(), PagerError> {
    drive(lock, "discarding", discard_step(pages))
}

/// Flushes the pager behind `lock` ([`flush_step`]), without the lock between steps.
fn flush<T: Transport, D: Disk>(
    lock: &Mutex<Inner<T, D>>,
    only: Option<&[u64]>,
) -> Result<(), PagerError> {
    let step = flush_step(&guard(lock), only);
    drive(lock, "flushing", step)
}

// ---------------------------------------------------------------------------------------------
// The same operations for one event loop that serves many requests at once (the NBD server's
// transmission loop): nothing here waits. A read or a step that cannot go on returns
// `Poll::Pending` with its task's waker kept; taking replies in (the loop's
// [`SharedPager::take_in_from`], or any holder of the lock, as a maintenance tick) wakes the
// reads it finished and every operation waiting for progress. The loop, not the operation,
// watches the page servers' connections ([`SharedPager::reply_fds`]).

/// A read of an event loop's operation ([`SharedPager::read_pages_async`]).
struct ReadPages<'a, T: Transport, D: Disk> {
    lock: &'a Mutex<Inner<T, D>>,
    pages: &'a [u64],
    out: &'a mut Vec<u8>,
    /// Its read by ticket, once one was needed.
    id: Option<u64>,
}

impl<T: Transport, D: Disk> ReadPages<'_, T, D> {
    /// Copies out what needs no I/O and registers the misses as a read by ticket (`None`: no
    /// miss, the read is done).
    fn begin(&mut self, inner: &mut Inner<T, D>) -> Result<Option<u64>, PagerError> {
        begin_read(inner, self.pages, self.out, None)
    }

    /// Its read's end: the buffer back in place, the first failure if any.
    fn end(&mut self, inner: &mut Inner<T, D>, id: u64) -> Result<(), PagerError> {
        self.id = None;
        let r = inner.reads.remove(&id).expect("a read in flight");
        *self.out = r.out;
        r.failed.map_or(Ok(()), Err)
    }
}

impl<T: Transport, D: Disk> Future for ReadPages<'_, T, D> {
    type Output = Result<(), PagerError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let mut locked = guard(this.lock);
        let inner = &mut *locked.0;
        let id = match this.id {
            Some(id) => id,
            None => match this.begin(inner) {
                Ok(None) => return Poll::Ready(Ok(())),
                Ok(Some(id)) => {
                    this.id = Some(id);
                    id
                }
                Err(e) => return Poll::Ready(Err(e)),
            },
        };
        loop {
            if let Err(e) = inner.start(id) {
                // Its tickets already out finish into nothing (see `Inner::route`).
                let _ = this.end(inner, id);
                return Poll::Ready(Err(e));
            }
            let r = inner.reads.get_mut(&id).expect("a read in flight");
            if r.left == 0 {
                return Poll::Ready(this.end(inner, id));
            }
            r.waker = Some(cx.waker().clone());
            if r.started < r.pages.len() {
                // Pages wait for slots, which any reply may free.
                inner.progress.push(cx.waker().clone());
            }
            if inner.pager.awaits_replies() && inner.pager.has_reply_fds() {
                return Poll::Pending;
            }
            // Nothing the loop could watch (a transport in memory, or only degraded reads
            // left, which the next take decodes): waited for here, as every read was before.
            if let Err(e) = inner.pager.wait_finished() {
                let _ = this.end(inner, id);
                return Poll::Ready(Err(e));
            }
            inner.route();
        }
    }
}

impl<T: Transport, D: Disk> Drop for ReadPages<'_, T, D> {
    fn drop(&mut self) {
        // A read given up on before its end: its tickets finish into nothing.
        if let Some(id) = self.id {
            guard(self.lock).0.reads.remove(&id);
        }
    }
}

/// Pending once, with its task woken when replies are next taken in (or by a holder of the
/// lock): an event loop's operation waiting for any progress.
struct Progress<'a, T: Transport, D: Disk> {
    lock: &'a Mutex<Inner<T, D>>,
    waited: bool,
}

impl<T: Transport, D: Disk> Future for Progress<'_, T, D> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        if this.waited {
            return Poll::Ready(());
        }
        this.waited = true;
        guard(this.lock).0.progress.push(cx.waker().clone());
        Poll::Pending
    }
}

/// [`drive`] for an event loop's operation: `step(pager, false)` until it returns true,
/// pending (the lock let go) while replies come in.
async fn drive_async<T: Transport, D: Disk>(
    lock: &Mutex<Inner<T, D>>,
    mut step: impl FnMut(&mut Pager<T, D>, bool) -> Result<bool, PagerError>,
) -> Result<(), PagerError> {
    let mut first = true;
    loop {
        {
            let mut inner = guard(lock);
            if std::mem::take(&mut first) && inner.sends_waiting() {
                take_in(&mut inner);
            }
            if step(&mut inner, false)? {
                return Ok(());
            }
            if !inner.has_reply_fds() {
                // Nothing in flight could move it on: one step the waiting way (see `drive`).
                if step(&mut inner, true)? {
                    return Ok(());
                }
                continue;
            }
        }
        Progress {
            lock,
            waited: false,
        }
        .await;
    }
}

impl<T: Transport, D: Disk> SharedPager<T, D> {
    /// [`SharedPager::read_pages`] for an event loop: pending, with nothing held, until the
    /// loop has taken in the replies the misses wait for.
    pub fn read_pages_async<'a>(
        &'a self,
        pages: &'a [u64],
        out: &'a mut Vec<u8>,
    ) -> impl Future<Output = Result<(), PagerError>> + 'a {
        ReadPages {
            lock: &self.lock,
            pages,
            out,
            id: None,
        }
    }

    /// Counts as an operation under way ([`SharedPager::busy`]) for as long as the result
    /// lives: an event loop holds one while operations of its are in flight.
    pub fn hold_busy(&self) -> Busy<'_> {
        Busy::new(&self.busy)
    }

    /// [`SharedPager::drive`] for an event loop.
    pub async fn drive_async(
        &self,
        step: impl FnMut(&mut Pager<T, D>, bool) -> Result<bool, PagerError>,
    ) -> Result<(), PagerError> {
        drive_async(&self.lock, step).await
    }

    /// [`SharedPager::write_pages`] for an event loop.
    pub async fn write_pages_async(&self, pages: &[u64], data: &[u8]) -> Result<(), PagerError> {
        drive_async(&self.lock, write_step(pages, data)).await
    }

    /// [`SharedPager::discard_pages`] for an event loop.
    pub async fn discard_pages_async(&self, pages: &[u64]) -> Result<(), PagerError> {
        drive_async(&self.lock, discard_step(pages)).await
    }

    /// [`SharedPager::flush`] for an event loop.
    pub async fn flush_async(&self, only: Option<&[u64]>) -> Result<(), PagerError> {
        let step = flush_step(&guard(&self.lock), only);
        drive_async(&self.lock, step).await
    }

    /// The page servers' connections an event loop watches for replies, with their servers.
    pub fn reply_fds(&self, out: &mut Vec<(usize, RawFd)>) {
        out.clear();
        guard(&self.lock).reply_fds_by_server(out);
    }

    /// Takes in the replies of the servers in `readable` (their connections were found
    /// readable), fails servers past the reply timeout, and wakes the reads this finished and
    /// the operations waiting for progress.
    pub fn take_in_from(&self, readable: impl IntoIterator<Item = usize>) {
        let mut locked = guard(&self.lock);
        let inner = &mut *locked.0;
        if let Err(e) = inner.pager.poll_from(readable) {
            tracing::debug!("while taking in replies: {e}");
        }
        inner.pager.expire(netram_pager::real_time_us());
        inner.route();
        inner.wake_progress();
    }
}
