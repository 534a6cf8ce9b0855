//! The region's events as the handler reads them, and a watcher that reads them for a handler
//! that cannot: so that a `fork` never waits for good (Anemone §2.2's transparency to
//! unmodified programs, kept across `fork`).
//!
//! Where the region follows forks (`UFFD_FEATURE_EVENT_FORK`), the kernel holds a `fork` until
//! the region's handler has *read* the fork's event. The C library's `fork` holds every lock of
//! its allocator across that system call. A handler that allocates through the C library at
//! that moment (it does, between events), or that waits for the region's lock while another
//! thread holding it allocates, then waits for the `fork`, which waits for it: the process
//! hangs for good (seen in the test suite under load, ~1 run in 40, the handler asleep on an
//! arena lock of the C library and the forking thread in `userfaultfd_event_wait_completion`).
//! `netram run` escapes it by keeping netram's own memory off the C library's allocator (the
//! preload's arena), but a program using the region API or the C ABI does not.
//!
//! So every read of the descriptor goes through an [`Inbox`], and beside the handler runs a
//! watcher thread that allocates nothing and takes no lock but the inbox's (and that one only
//! if free): when the descriptor has stayed readable over two of its ticks while the handler
//! went no further round its loop, it reads the waiting events into the inbox's stash, whose
//! room was allocated beforehand, and wakes the handler. Reading a fork's event is all the
//! kernel waits for: the `fork` returns, the C library lets go of its locks, the handler goes
//! on and takes the stashed events first, in the order they were read. The handler never
//! allocates while it holds the inbox, so the watcher never waits for it.
//!
//! The same hang waits for a region being dropped: a `fork` that copied the process's
//! descriptors (the kernel does that first) and then the region's registered mapping queues
//! its event for a handler that has stopped, and the descriptor cannot be released by its
//! close, since the child being made holds a copy: that `fork` waited for good (seen in the
//! suite, a test's fork meeting another test's region as it went). So when the region goes,
//! the watcher is not joined: from the handler's stop it reads every event that comes
//! ([`keep_reading_until_quiet`]), closing the descriptors of such children (their copy of
//! a region dropped as they were forked is nobody's to serve), until none has come for
//! [`QUIET`] after the mapping is gone, and ends.

use crate::sys::{Event, Uffd};
use rustix::io::Errno;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

/// Events the stash holds at most: each waiting thread of the process has one fault queued at
/// a time, and a fork's event waits behind them (the kernel hands out faults first). A stash
/// that is full is taken by the handler before the watcher reads more.
pub(crate) const STASH: usize = 256;

/// How often the watcher looks: a `fork` that met a stuck handler waits two to three ticks.
pub(crate) const TICK: Duration = Duration::from_millis(100);

/// How long a dropped region's descriptor is read after its last event. A `fork` that copied
/// the mapping before it went queues its event as soon as the events it queued before for
/// other regions are read (each within a few ticks): seconds are ample.
pub(crate) const QUIET: Duration = Duration::from_secs(10);

/// The descriptor's reader side (see the module's comment).
#[derive(Debug)]
pub(crate) struct Inbox {
    /// Events the watcher read and the handler has not taken yet, oldest first; held while
    /// either reads the descriptor, so that events keep their order.
    stash: Mutex<Vec<Event>>,
    /// Whether the stash has events (read without the lock by the handler's loop).
    stashed: AtomicBool,
    /// The handler's turns round its loop (see [`Inbox::turn`]).
    turns: AtomicU64,
    /// Set when the region goes: the watcher ends.
    stop: AtomicBool,
}

impl Inbox {
    pub(crate) fn new() -> Self {
        Self {
            stash: Mutex::new(Vec::with_capacity(STASH)),
            stashed: AtomicBool::new(false),
            turns: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        }
    }

    /// Called by the handler at the top of its loop: a handler that turns is not stuck.
    pub(crate) fn turn(&self) {
        self.turns.fetch_add(1, Ordering::Relaxed);
    }

    /// Whether the watcher left events for the handler.
    pub(crate) fn has_stashed(&self) -> bool {
        self.stashed.load(Ordering::Acquire)
    }

    /// The handler's read: the stashed events first, then up to `max` from the descriptor
    /// (see [`Uffd::read_events`]), appended to `out`; how many came from the descriptor, so
    /// that fewer than `max` still means none was left there.
    pub(crate) fn read(
        &self,
        uffd: &Uffd,
        out: &mut Vec<Event>,
        max: usize,
    ) -> Result<usize, Errno> {
        // Room first: allocating with the stash held would keep the watcher out (the C
        // library's allocator may be what the handler waits for).
        out.reserve(STASH + max.min(crate::sys::MOST_EVENTS));
        let mut stash = self.stash.lock().unwrap_or_else(PoisonError::into_inner);
        if self.stashed.swap(false, Ordering::AcqRel) {
            out.append(&mut stash);
        }
        uffd.read_events(out, max)
    }

    /// One tick of the watcher, given the handler's turns and whether the descriptor was
    /// readable at the previous one; returns both for the next. Reads events into the stash
    /// when the descriptor stayed readable and the handler did not turn in between: it is
    /// stuck (or busy for a whole tick, when reading for it does no harm either). Counts the
    /// events it read in `rescued`.
    fn watch(
        &self,
        uffd: &Uffd,
        wake: &impl std::os::fd::AsFd,
        rescued: &AtomicU64,
        last: (u64, bool),
    ) -> (u64, bool) {
        let turns = self.turns.load(Ordering::Relaxed);
        let readable = crate::sys::readable_within(uffd, Duration::ZERO);
        if !(readable && last.1 && turns == last.0) {
            return (turns, readable);
        }
        // Never wait for the handler: it holds the stash only to read (without allocating).
        let Ok(mut stash) = self.stash.try_lock() else {
            return (turns, readable);
        };
        let room = STASH - stash.len();
        if room == 0 {
            return (turns, readable);
        }
        let before = stash.len();
        // Within the stash's capacity: no allocation. An error is the handler's to find.
        let _ = uffd.read_events(&mut stash, room.min(crate::sys::MOST_EVENTS));
        let read = stash.len() - before;
        if read > 0 {
            self.stashed.store(true, Ordering::Release);
            rescued.fetch_add(read as u64, Ordering::Relaxed);
            drop(stash);
            // The handler looks at the stash when it next turns (an eventfd's write).
            let _ = rustix::io::write(wake, &crate::handler::WAKE.to_ne_bytes());
        }
        (turns, readable)
    }

    /// The watcher's thread: ticks until [`Inbox::stop_watching`] (and an unpark).
    pub(crate) fn watch_until_stopped(
        &self,
        uffd: &Uffd,
        wake: &impl std::os::fd::AsFd,
        rescued: &AtomicU64,
    ) {
        let mut last = (u64::MAX, false);
        while !self.stop.load(Ordering::Acquire) {
            std::thread::park_timeout(TICK);
            last = self.watch(uffd, wake, rescued, last);
        }
    }

    pub(crate) fn stop_watching(&self) {
        self.stop.store(true, Ordering::Release);
    }
}

/// After the region's handler has stopped: reads whatever comes on `uffd` (the watcher's own
/// copy of the descriptor) until nothing has for [`QUIET`]. Faults are left alone (the
/// region's drop unregisters its range, which wakes their threads); a fork's event is read,
/// which lets the `fork` go on, and the child's descriptor closed. Allocates nothing where
/// `events` has room for [`crate::sys::MOST_EVENTS`].
pub(crate) fn keep_reading_until_quiet(uffd: &Uffd, events: &mut Vec<Event>) {
    let mut last = std::time::Instant::now();
    while last.elapsed() < QUIET {
        if !crate::sys::readable_within(uffd, TICK) {
            continue;
        }
        match uffd.read_events(events, crate::sys::MOST_EVENTS) {
            Ok(0) => {}
            Ok(_) => {
                // Children's descriptors are closed here.
                events.clear();
                last = std::time::Instant::now();
            }
            Err(_) => return,
        }
    }
}
