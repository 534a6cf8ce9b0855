//! The background half of reliability (Nswap §IV-B3): a thread that, while the program keeps
//! running, finds servers that died while nobody asked them anything (a probe), reconnects
//! those that come back (empty: a new incarnation), and rebuilds lost copies and pieces at a
//! bounded rate, so that recovery takes a bounded share of the pager (Nswap Table III).
//!
//! The pager is single-threaded and its owner (the NBD device, a region) holds it under a lock;
//! the thread takes that lock for one bounded step at a time.

use crate::open::ClientPager;
use netram_pager::{NextTick, Pacing, ScheduleConfig, Transport};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy)]
pub struct MaintainConfig {
    /// Pages (Reed-Solomon: stripes) rebuilt per step, under one hold of the pager's lock.
    pub batch: usize,
    /// Pages rebuilt per second at most: steps are spaced to keep below it.
    pub pages_per_s: u64,
    /// The share of the pager's time recovery may take: after a step that held the pager
    /// for `t`, the thread waits `t · (1 − duty) / duty`, so that the program keeps most of
    /// it (Nswap Table III: recovery must not slow programs down).
    pub duty: f64,
    /// Pages moved off servers that shrank their offer per step (Nswap §III), and the share
    /// of the pager's time migration may take: more than recovery's, because the server's
    /// machine is waiting for its memory. A step holds the pager (the program's reads wait
    /// behind it): 64 pages measured best on both counts (`netram bench adapt --quick`, this
    /// VM, 2026-11-25: 36,000–38,000 pages/s and a read p99 of ~0.7 ms during the move, against
    /// 26,000–27,000 and 2.2–2.7 ms with 512 or 128, 29,000–32,000 and 0.3–0.5 ms with 16 or 32).
    pub migrate_batch: usize,
    pub migrate_duty: f64,
    /// How often every server is asked for an empty reply.
    pub probe_every: Duration,
    /// How often dead servers are tried again.
    pub reconnect_every: Duration,
    /// How often this machine's daemon is asked which members the cluster declared down
    /// (`crate::discover`); a server of the pager among them is probed at once, and failed
    /// only if it does not answer. `None`: never.
    pub membership_every: Option<Duration>,
}

impl Default for MaintainConfig {
    fn default() -> Self {
        Self {
            batch: 64,
            pages_per_s: 100_000,
            duty: 0.05,
            migrate_batch: 64,
            migrate_duty: 0.5,
            probe_every: Duration::from_secs(2),
            reconnect_every: Duration::from_secs(1),
            membership_every: Some(Duration::from_secs(1)),
        }
    }
}

/// The running thread; stops when dropped.
#[derive(Debug)]
pub struct Maintenance {
    stop: Arc<AtomicBool>,
    paused: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Maintenance {
    /// Holds the thread (no probes, reconnections or recovery) until resumed: for a phase
    /// that must not share the pager, and for measuring what recovery costs a program, side
    /// by side with the same failure ([`netram bench reliability`]).
    pub fn pause(&self, paused: bool) {
        self.paused.store(paused, Ordering::SeqCst);
        if let Some(t) = &self.thread {
            t.thread().unpark();
        }
    }
}

impl Drop for Maintenance {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

/// Starts the thread. `with_pager` runs a closure on the pager under its owner's lock.
pub fn spawn<F>(with_pager: F, cfg: MaintainConfig) -> Maintenance
where
    F: Fn(&mut dyn FnMut(&mut ClientPager)) + Send + 'static,
{
    start(with_pager, || false, cfg, true)
}

/// [`spawn`] for a pager that threads share through [`crate::SharedPager`] (`netram nbd`'s
/// device): `busy` says whether one of them is reading or writing
/// ([`crate::SharedPager::busy`]). It then takes in every reply that comes, whoever it is for,
/// and sends what the replies let go; so the thread does not wake for replies itself, but
/// ticks at the pace its schedule sets. (When it did, each reply woke both, and the tick took
/// the lock and the reply from under the reader: `netram bench adapt`'s owner, reading while
/// its pages moved server to server, had a p99 of 1–3 ms against 0.2–0.4 ms.)
pub fn spawn_beside<F, B>(with_pager: F, busy: B, cfg: MaintainConfig) -> Maintenance
where
    F: Fn(&mut dyn FnMut(&mut ClientPager)) + Send + 'static,
    B: Fn() -> bool + Send + 'static,
{
    start(with_pager, busy, cfg, true)
}

/// Starts a thread that only follows membership (`cfg.membership_every`; none if that is
/// `None`), for a pager whose schedule another loop ticks: a region's handler runs it between
/// faults. Asking the local daemon is a blocking HTTP call, which that loop must not make; the
/// thread takes the pager's lock only when the daemon's answer calls for it (a server declared
/// down, a member that joined).
pub fn spawn_membership<F>(with_pager: F, cfg: MaintainConfig) -> Maintenance
where
    F: Fn(&mut dyn FnMut(&mut ClientPager)) + Send + 'static,
{
    if cfg.membership_every.is_none() {
        return Maintenance {
            stop: Arc::new(AtomicBool::new(false)),
            paused: Arc::new(AtomicBool::new(false)),
            thread: None,
        };
    }
    start(with_pager, || false, cfg, false)
}

fn start<F, B>(with_pager: F, busy: B, cfg: MaintainConfig, ticks: bool) -> Maintenance
where
    F: Fn(&mut dyn FnMut(&mut ClientPager)) + Send + 'static,
    B: Fn() -> bool + Send + 'static,
{
    let stop = Arc::new(AtomicBool::new(false));
    let paused = Arc::new(AtomicBool::new(false));
    let thread = {
        let (stop, paused) = (stop.clone(), paused.clone());
        std::thread::Builder::new()
            .name("netram-maintain".into())
            .spawn(move || run(with_pager, busy, cfg, ticks, &stop, &paused))
            .expect("spawn maintenance thread")
    };
    Maintenance {
        stop,
        paused,
        thread: Some(thread),
    }
}

/// What the local daemon said last of the members that were declared down.
#[derive(Debug, Default)]
struct Membership {
    asked: Option<Instant>,
    /// Members declared down whose servers were probed already: (address, boot). A member
    /// acted on once is not probed again on membership's word until it comes back with a new
    /// boot and is declared down again (the regular probes go on meanwhile).
    acted: std::collections::HashSet<(std::net::SocketAddr, u64)>,
    /// The daemon could not be reached last time (said once, not every second).
    unreachable: bool,
    /// New members that could not be connected to, and when to try again (the connection
    /// is made under the pager's lock: an unreachable member must not hold it every second).
    not_before: std::collections::HashMap<std::net::SocketAddr, Instant>,
}

impl Membership {
    fn check<F>(&mut self, every: Duration, with_pager: &F)
    where
        F: Fn(&mut dyn FnMut(&mut ClientPager)),
    {
        if self.asked.is_some_and(|t| t.elapsed() < every) {
            return;
        }
        self.asked = Some(Instant::now());
        let daemon = crate::discover::daemon_addr();
        let list = match crate::discover::members(&daemon, Duration::from_millis(500)) {
            Ok(l) => {
                self.unreachable = false;
                l
            }
            Err(e) => {
                if !self.unreachable {
                    // A client with a server list of its own goes on with it, and says so.
                    match e {
                        crate::discover::DiscoverError::Untrusted { .. } => tracing::warn!(
                            "membership not followed (this client keeps to its own servers): {e}"
                        ),
                        _ => tracing::debug!("membership not followed: {e}"),
                    }
                }
                self.unreachable = true;
                return;
            }
        };
        let down: Vec<_> = list
            .members
            .iter()
            .filter(|r| r.state == netram_member::Liveness::Down)
            .filter(|r| !self.acted.contains(&(r.addr, r.boot)))
            .map(|r| (r.addr, r.boot))
            .collect();
        let live: Vec<std::net::SocketAddr> = list
            .members
            .iter()
            .filter(|r| !r.is_self && r.state != netram_member::Liveness::Down)
            .map(|r| r.addr)
            .collect();
        let not_before = &mut self.not_before;
        with_pager(&mut |p| {
            let known: Vec<Option<std::net::SocketAddr>> =
                p.transport().servers().iter().map(|s| s.addr).collect();
            for (i, addr) in known.iter().enumerate() {
                let declared = addr.is_some_and(|a| down.iter().any(|(d, _)| *d == a));
                let alive = p.servers().nth(i).is_some_and(|(_, alive)| alive);
                if declared && alive {
                    // A hint, not evidence: the server is asked now, and is failed only if
                    // this client's own connection says so (it broke, or the probe's reply
                    // did not come within the reply timeout). A daemon that was flooded,
                    // partitioned from its peers, or lies, costs no page.
                    match p.probe_server(i) {
                        Ok(true) => tracing::warn!(
                            server = i,
                            "the cluster declared this server down, and it does not answer"
                        ),
                        Ok(false) => tracing::info!(
                            server = i,
                            "the cluster declared this server down, but it answers: kept"
                        ),
                        Err(e) => {
                            tracing::warn!(server = i, "probe of a server declared down: {e}")
                        }
                    }
                }
            }
            // Members that joined after the pager started, if its servers are the daemon's.
            if p.transport().discovered() {
                let now = Instant::now();
                for a in live.iter().filter(|a| !known.contains(&Some(**a))) {
                    if not_before.get(a).is_some_and(|t| now < *t) {
                        continue;
                    }
                    match p.add_server(&a.to_string()) {
                        Ok(i) => tracing::info!(server = i, addr = %a, "a new member is used"),
                        Err(e) => {
                            tracing::debug!("member {a} not used yet: {e}");
                            not_before.insert(*a, now + Duration::from_secs(10));
                        }
                    }
                }
            }
        });
        self.acted.extend(down);
    }
}

impl MaintainConfig {
    /// The pager's schedule under this configuration; `reply_timeout` is the transport's
    /// (a probe, or a request waited for, unanswered that long fails its server).
    pub fn schedule(&self, reply_timeout: Duration) -> ScheduleConfig {
        ScheduleConfig {
            probe_every_us: self.probe_every.as_micros() as u64,
            reconnect_every_us: self.reconnect_every.as_micros() as u64,
            recover_batch: self.batch,
            migrate_batch: self.migrate_batch,
            reply_timeout_us: reply_timeout.as_micros() as u64,
        }
    }

    /// How the ticks are spaced.
    pub fn pacing(&self) -> Pacing {
        Pacing {
            pages_per_s: self.pages_per_s,
            duty: self.duty,
            migrate_duty: self.migrate_duty,
            ..Pacing::default()
        }
    }
}

fn run<F, B>(
    with_pager: F,
    busy: B,
    cfg: MaintainConfig,
    ticks: bool,
    stop: &AtomicBool,
    paused: &AtomicBool,
) where
    F: Fn(&mut dyn FnMut(&mut ClientPager)),
    B: Fn() -> bool,
{
    // The schedule itself (what is due when) is the pager's, run on the process's clock
    // (`real_time_us`, as a region's handler runs it); the simulator runs the same one on its
    // virtual clock.
    let pacing = cfg.pacing();
    if ticks {
        with_pager(&mut |p| p.set_schedule(cfg.schedule(p.transport().reply_timeout())));
    }
    let mut membership = Membership::default();
    while !stop.load(Ordering::SeqCst) {
        if paused.load(Ordering::SeqCst) {
            std::thread::park_timeout(Duration::from_millis(50));
            continue;
        }
        if let Some(every) = cfg.membership_every {
            membership.check(every, &with_pager);
        }
        if !ticks {
            // Membership alone: its own pace.
            std::thread::park_timeout(cfg.membership_every.unwrap_or(Duration::from_secs(1)));
            continue;
        }
        let started = Instant::now();
        let mut next = NextTick {
            least_us: pacing.idle_us,
            most_us: pacing.idle_us,
        };
        let mut replies = Vec::new();
        let mut queued = false;
        with_pager(&mut |p| match p.on_tick(netram_pager::real_time_us()) {
            Ok(tick) => {
                tick.report();
                next = pacing.next(&tick, started.elapsed().as_micros() as u64);
                queued = p.sends_waiting();
                if next.awaits_answers() || queued {
                    p.reply_fds(&mut replies);
                }
            }
            Err(e) => tracing::warn!("maintenance: {e}"),
        });
        // The next tick comes after `least` (the program's share of the pager), and at the
        // latest after `most`; sooner than `most` when a reply that moves or recovery wait
        // for arrives.
        let least = Duration::from_micros(next.least_us);
        let most = Duration::from_micros(next.most_us);
        if busy() {
            // A reader or writer takes the replies in and sends what is queued (see
            // `spawn_beside`): the next tick comes when the schedule says, at the latest.
            std::thread::park_timeout(most);
            continue;
        }
        if queued {
            send_as_credits_return(&with_pager, least, &mut replies);
        } else {
            std::thread::park_timeout(least);
        }
        if most > least && !replies.is_empty() {
            wait_for_replies(&replies, most - least);
        } else if most > least {
            std::thread::park_timeout(most - least);
        }
    }
}

/// Until `least` has passed: takes in the replies that arrive and sends what their credits
/// let go of what the tick queued (a tick never waits for credits: it runs under the pager's
/// lock). Without this, a move's or recovery's requests beyond a server's window went only at
/// the next tick: moves through the client ran at 0.71× the rate of ticks that waited
/// (`bench adapt --quick`, 4 pairs). `replies` is left with the descriptors to wait on next.
fn send_as_credits_return<F>(with_pager: &F, least: Duration, replies: &mut Vec<std::os::fd::RawFd>)
where
    F: Fn(&mut dyn FnMut(&mut ClientPager)),
{
    let until = Instant::now() + least;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        if replies.is_empty() {
            std::thread::park_timeout(left);
            return;
        }
        wait_for_replies(replies, left);
        replies.clear();
        let mut queued = false;
        with_pager(&mut |p| {
            if let Err(e) = p.poll() {
                tracing::debug!("maintenance: {e}");
            }
            p.send_queued();
            queued = p.sends_waiting();
            p.reply_fds(replies);
        });
        if !queued {
            std::thread::park_timeout(until.saturating_duration_since(Instant::now()));
            return;
        }
    }
}

/// Waits up to `most` for one of the pager's connections to have a reply to read (or to
/// close). The descriptors were taken under the pager's lock, and the wait is outside it: one
/// closed or reused meanwhile (this thread reconnecting a server, later) is at worst an early
/// wake-up, after which the tick reads replies through the pager, by its current connections.
fn wait_for_replies(fds: &[std::os::fd::RawFd], most: Duration) {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let mut polled: Vec<PollFd<'_>> = fds
        .iter()
        .map(|&fd| {
            // SAFETY: poll only looks at the descriptor number, for the length of this call;
            // see above for one closed or reused meanwhile.
            PollFd::from_borrowed_fd(
                unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) },
                PollFlags::IN,
            )
        })
        .collect();
    let timeout = Timespec {
        tv_sec: most.as_secs() as i64,
        tv_nsec: i64::from(most.subsec_nanos()),
    };
    if let Err(e) = poll(&mut polled, Some(&timeout)) {
        if e != rustix::io::Errno::INTR {
            tracing::debug!("maintenance: poll: {e}");
        }
    }
}
