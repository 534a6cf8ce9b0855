//! The maintenance schedule (Nswap §IV-B3: a node finds out that another is unreachable and
//! recovery rebuilds what it held while programs keep running): the replies that arrived while
//! the program was elsewhere, when to probe the servers nobody has asked anything lately, when
//! to try the dead ones again, and a bounded step of recovery whenever pages lack copies.
//!
//! It keeps no clock of its own: [`Pager::on_tick`] is told the time, in microseconds from any
//! origin, so that the same schedule runs in the daemon's maintenance thread
//! (`netram_client::maintain`, real time) and in the simulator (virtual time). How often the
//! thread ticks, and how it spaces recovery steps to bound their share of the pager, stays with
//! the thread: that depends on how long a step held the pager, which only real time measures.

use crate::requests::Op;
use crate::{Disk, Pager, PagerError, Transport, TransportError};
use netram_proto::Request;
use std::collections::BTreeMap;

/// How often each task is due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduleConfig {
    /// Every server is asked for an empty reply this often (µs).
    pub probe_every_us: u64,
    /// Dead servers are tried again this often (µs).
    pub reconnect_every_us: u64,
    /// Pages (Reed-Solomon: stripes) rebuilt per tick at most.
    pub recover_batch: usize,
    /// Pages moved off servers that shrank their offer, per tick at most.
    pub migrate_batch: usize,
    /// A probe, or a request an operation waits for, not answered within this long (µs)
    /// fails its server: the transport's reply timeout, applied by the pager itself to what
    /// nobody waits on the transport for (reads by ticket, probes, write-backs).
    pub reply_timeout_us: u64,
}

impl Default for ScheduleConfig {
    fn default() -> Self {
        Self {
            probe_every_us: 2_000_000,
            reconnect_every_us: 1_000_000,
            recover_batch: 64,
            migrate_batch: 256,
            reply_timeout_us: 5_000_000,
        }
    }
}

/// The time to give [`Pager::on_tick`] in a loop that runs on real time: microseconds since
/// the first call in this process. One origin for every such loop, so that a pager ticked by
/// one and later by another (a region's handler, a maintenance thread) never sees its clock go
/// back: a probe sent at a later time than "now" would never be late, nor the next one due.
pub fn real_time_us() -> u64 {
    static ORIGIN: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    ORIGIN
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_micros() as u64
}

/// How a loop that ticks the schedule in real time spaces its ticks, so that maintenance takes
/// a bounded share of the pager (Nswap Table III: recovery must not slow programs down) and
/// migration a larger one (the donor's machine is waiting for its memory). The same rule for
/// every such loop: the maintenance thread (`netram_client::maintain`) and a region's handler,
/// which runs the schedule between faults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pacing {
    /// Pages (Reed-Solomon: stripes) rebuilt per second at most.
    pub pages_per_s: u64,
    /// The share of the pager's time recovery may take: after a tick that held the pager for
    /// `t`, the next comes after `t · (1 − duty) / duty` at the earliest.
    pub duty: f64,
    /// The same for migration.
    pub migrate_duty: f64,
    /// The pause between ticks with nothing under way (µs).
    pub idle_us: u64,
    /// While pages move or recovery's reads are out, the next tick comes at the latest this
    /// long after the last (µs), sooner when one of their answers arrives: each answer lets
    /// the next request go.
    pub answer_poll_us: u64,
}

impl Default for Pacing {
    fn default() -> Self {
        Self {
            pages_per_s: 100_000,
            duty: 0.05,
            migrate_duty: 0.5,
            idle_us: 50_000,
            answer_poll_us: 300,
        }
    }
}

/// When the next tick is due, from the end of the last (µs): not before `least`, and at
/// `most` at the latest; between the two, as soon as an answer that moves or recovery wait
/// for arrives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NextTick {
    pub least_us: u64,
    pub most_us: u64,
}

impl NextTick {
    /// Whether replies arriving between `least` and `most` are worth a tick.
    pub fn awaits_answers(&self) -> bool {
        self.most_us > self.least_us
    }
}

impl Pacing {
    /// The next tick after `tick`, which held the pager for `held_us`.
    pub fn next(&self, tick: &Tick, held_us: u64) -> NextTick {
        let share = |duty: f64| {
            let duty = duty.clamp(0.01, 1.0);
            (held_us as f64 * (1.0 - duty) / duty) as u64
        };
        let fixed = |us: u64| NextTick {
            least_us: us,
            most_us: us,
        };
        if tick.migrated > 0 || tick.handing > 0 {
            // Back soon: the pages go as fast as the program's share of the pager allows.
            // Moves that do not wait hold the pager only to send requests and take answers
            // in; each answer lets the next request of its move go, so the loop wakes for it
            // rather than only after a fixed pause.
            let share = share(self.migrate_duty);
            if tick.handing > 0 {
                let least = share.min(5_000);
                NextTick {
                    least_us: least,
                    most_us: least.max(self.answer_poll_us),
                }
            } else {
                fixed(share)
            }
        } else if tick.rebuilt > 0 {
            // Spaced so that `pages_per_s` and `duty` hold; the step itself counts.
            let rate = tick.rebuilt as u64 * 1_000_000 / self.pages_per_s.max(1);
            fixed(rate.saturating_sub(held_us).max(share(self.duty)))
        } else if tick.rebuilding > 0 {
            // Recovery's reads are out and none was in yet: their copies go at the next tick,
            // soon.
            NextTick {
                least_us: 0,
                most_us: self.answer_poll_us,
            }
        } else {
            fixed(self.idle_us)
        }
    }
}

/// When each task last ran; `None` before the first tick, which starts the clocks.
#[derive(Debug, Clone, Default)]
pub(crate) struct Schedule {
    pub(crate) cfg: ScheduleConfig,
    last_probe: Option<u64>,
    last_reconnect: Option<u64>,
    /// The schedule's probes not known answered yet: per server, the request and when it
    /// went. (Ordered: the simulator replays a seed exactly.)
    probes: BTreeMap<usize, (u64, u64)>,
}

impl Schedule {
    /// The default schedule, with the transport's reply timeout if it has one.
    pub(crate) fn with_reply_timeout(reply_timeout_us: Option<u64>) -> Self {
        let mut s = Self::default();
        if let Some(t) = reply_timeout_us {
            s.cfg.reply_timeout_us = t;
        }
        s
    }
}

/// What one tick did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tick {
    /// Replies that had arrived and were handled (write-backs finished while the program
    /// was elsewhere).
    pub replies: usize,
    /// Dead servers that answered again (empty: a new incarnation).
    pub revived: usize,
    /// Servers found dead by the tick: a probe unanswered for the probe timeout, or a
    /// connection found broken.
    pub found_dead: usize,
    /// Pages whose rebuild started, and pages found lost for good.
    pub rebuilt: usize,
    pub unrecoverable: usize,
    /// Pages whose move off a server that shrank its offer started.
    pub migrated: usize,
    /// Pages moving after the tick, whose answers the next ticks take in: server to server,
    /// or through this pager with their read out.
    pub handing: usize,
    /// Pages (stripes under `rs:K+M`) whose recovery reads are out after the tick: a later
    /// tick writes their copies (rebuilds their pieces).
    pub rebuilding: usize,
}

impl Tick {
    /// Logs what a tick found that its owner should hear of.
    pub fn report(&self) {
        if self.revived > 0 {
            tracing::info!("{} server(s) reconnected (empty)", self.revived);
        }
        if self.unrecoverable > 0 {
            tracing::error!("{} page(s) lost for good", self.unrecoverable);
        }
    }
}

impl Schedule {
    /// Whether a task last run at `last` is due at `now`; the first call starts its clock.
    fn due(last: &mut Option<u64>, every: u64, now: u64) -> bool {
        match *last {
            Some(t) if now.saturating_sub(t) < every => false,
            Some(_) => {
                *last = Some(now);
                true
            }
            None => {
                *last = Some(now);
                false
            }
        }
    }
}

impl<T: Transport, D: Disk> Pager<T, D> {
    /// Sets how often the maintenance tasks are due (see [`Pager::on_tick`]).
    pub fn set_schedule(&mut self, cfg: ScheduleConfig) {
        self.schedule.cfg = cfg;
    }

    /// Runs the maintenance tasks due at `now` (µs): handling the replies already there
    /// ([`Pager::poll`]), failing the servers whose probes went unanswered, reconnecting dead
    /// servers, probing the live ones, one bounded step of recovery while pages lack copies,
    /// and one of migration while servers want pages moved ([`Pager::migrate`]). The first
    /// tick only starts the clocks. A failed task is returned; the tasks after it wait for the
    /// next tick.
    ///
    /// A tick never waits for a probe: the probe is sent, its reply handled by whichever call
    /// reads that server's replies, and a later tick fails the server if none came within
    /// `reply_timeout_us`. (Waiting held the pager, and its owner's lock, for every reply in
    /// flight, and for the whole reply timeout when a server hung.)
    pub fn on_tick(&mut self, now_us: u64) -> Result<Tick, PagerError> {
        // Recovery's and migration's requests that find no credit queue, and go with the
        // replies that return credits or the `send_queued` below; they do not wait for them.
        self.must_not_wait += 1;
        let tick = self.tick_without_waiting(now_us);
        self.must_not_wait -= 1;
        self.send_queued();
        tick
    }

    fn tick_without_waiting(&mut self, now_us: u64) -> Result<Tick, PagerError> {
        let cfg = self.schedule.cfg;
        let mut tick = Tick {
            replies: self.poll()?,
            ..Tick::default()
        };
        let dead_before = self.counters.servers_dead;
        self.check_probes(now_us);
        self.expire(now_us);
        if Schedule::due(
            &mut self.schedule.last_reconnect,
            cfg.reconnect_every_us,
            now_us,
        ) {
            tick.revived = self.revive_dead_servers();
        }
        if Schedule::due(&mut self.schedule.last_probe, cfg.probe_every_us, now_us) {
            self.start_probes(now_us);
        }
        tick.found_dead = (self.counters.servers_dead - dead_before) as usize;
        if self.degraded_pages() > 0 {
            let step = self.recover(cfg.recover_batch)?;
            tick.rebuilt = step.started;
            tick.unrecoverable = step.unrecoverable;
        }
        if self.migration_due() {
            tick.migrated = self.migrate(cfg.migrate_batch)?.started;
        }
        tick.handing = self.pages_in_handover() + self.moving.len();
        tick.rebuilding = self.rebuilding_pages();
        Ok(tick)
    }
}

impl<T: Transport, D: Disk> Pager<T, D> {
    /// Probes of the maintenance schedule sent and not answered yet.
    pub fn probes_in_flight(&self) -> usize {
        self.schedule
            .probes
            .iter()
            .filter(|&(&s, &(id, _))| self.servers[s].alive && self.pending(s, id))
            .count()
    }

    /// Sends an empty GET to every live server without a probe unanswered (see
    /// [`Pager::on_tick`]).
    fn start_probes(&mut self, now_us: u64) {
        // What a migration step found unmovable (in write-back, being rebuilt) may have
        // become movable since without the server's count changing: look again.
        self.servers.iter_mut().for_each(|s| s.leaving_stuck = 0);
        for s in 0..self.servers.len() {
            if !self.servers[s].alive || self.schedule.probes.contains_key(&s) {
                continue;
            }
            if let Some(id) = self.submit(s, Op::Get(Vec::new()), &Request::Get(Vec::new())) {
                self.schedule.probes.insert(s, (id, now_us));
            }
        }
        self.counters.probe_rounds += 1;
        self.send_queued();
    }

    /// Fails every server that has left a request unanswered for the reply timeout
    /// ([`ScheduleConfig::reply_timeout_us`]) at `now_us`; returns how many. A loop that never
    /// waits on the transport calls this (it is part of [`Pager::on_tick`]) to find a server
    /// that hangs: a read waiting for it then goes to another copy, the disk or
    /// reconstruction, as when its connection fails. Never waits; cheap enough to call on
    /// every turn of a loop.
    pub fn expire(&mut self, now_us: u64) -> usize {
        let timeout = self.schedule.cfg.reply_timeout_us;
        let late = self.inflight.late(now_us, timeout);
        for &s in &late {
            if !self.servers[s].alive {
                continue;
            }
            self.counters.requests_timed_out += 1;
            tracing::warn!(
                server = s,
                timeout_ms = timeout / 1000,
                "a request unanswered past the reply timeout: the server is taken for dead"
            );
            self.on_failure(s, TransportError::Timeout(timeout / 1000));
        }
        late.len()
    }

    /// Forgets the probes answered (or whose server failed meanwhile), and fails the servers
    /// whose probe has waited `reply_timeout_us`.
    fn check_probes(&mut self, now_us: u64) {
        let timeout = self.schedule.cfg.reply_timeout_us;
        let mut late = Vec::new();
        for (s, (id, sent)) in std::mem::take(&mut self.schedule.probes) {
            if !self.servers[s].alive || !self.pending(s, id) {
                continue;
            }
            if now_us.saturating_sub(sent) >= timeout {
                late.push(s);
            } else {
                self.schedule.probes.insert(s, (id, sent));
            }
        }
        for s in late {
            self.counters.probes_unanswered += 1;
            tracing::warn!(
                server = s,
                "no answer to a probe: the server is taken for dead"
            );
            self.on_failure(s, TransportError::Timeout(timeout / 1000));
        }
    }
}

#[cfg(test)]
mod pacing_tests {
    use super::*;

    #[test]
    fn ticks_are_spaced_by_what_is_under_way() {
        let p = Pacing::default();
        let idle = p.next(&Tick::default(), 10);
        assert_eq!((idle.least_us, idle.most_us), (50_000, 50_000));
        assert!(!idle.awaits_answers());
        // A migration step that held the pager 100 µs at a duty of one half: 100 µs for the
        // program; with moves out, woken by their answers until the poll interval.
        let moving = Tick {
            migrated: 64,
            handing: 64,
            ..Tick::default()
        };
        let next = p.next(&moving, 100);
        assert_eq!((next.least_us, next.most_us), (100, 300));
        assert!(next.awaits_answers());
        // A long step: the program's share caps at 5 ms.
        assert_eq!(p.next(&moving, 1_000_000).least_us, 5_000);
        let through_owner = Tick {
            migrated: 64,
            ..Tick::default()
        };
        assert_eq!(p.next(&through_owner, 2_000).most_us, 2_000);
        // Recovery: 64 pages at 100,000 a second is 640 µs, less the step's own 10 µs; a
        // longer step is followed by 19 times its length (a 5 % duty).
        let rebuilt = Tick {
            rebuilt: 64,
            ..Tick::default()
        };
        assert_eq!(p.next(&rebuilt, 10).least_us, 630);
        assert_eq!(p.next(&rebuilt, 40).least_us, 760);
        assert_eq!(p.next(&rebuilt, 1_000).least_us, 19_000);
        let reading = Tick {
            rebuilding: 3,
            ..Tick::default()
        };
        let next = p.next(&reading, 10);
        assert_eq!((next.least_us, next.most_us), (0, 300));
    }
}

/// What a loop that runs the schedule itself between its own work is given (a region's
/// handler, `netram nbd`'s transmission loop): the schedule, and how its ticks are spaced.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Upkeep {
    pub schedule: ScheduleConfig,
    pub pacing: Pacing,
}

/// When such a loop ticks next, in real time: not before `least` (its own work's share of the
/// thread), at `most` at the latest, and in between as soon as a reply arrives when moves or
/// recovery wait for answers.
#[derive(Debug)]
pub struct Ticker {
    /// The schedule last given to the pager.
    given: Option<ScheduleConfig>,
    least: std::time::Instant,
    most: std::time::Instant,
}

impl Default for Ticker {
    fn default() -> Self {
        Self::new()
    }
}

impl Ticker {
    pub fn new() -> Self {
        let now = std::time::Instant::now();
        Self {
            given: None,
            least: now,
            most: now,
        }
    }

    /// Whether replies arriving now are worth a tick (the loop then watches the pager's
    /// connections for them).
    pub fn listens(&self, now: std::time::Instant) -> bool {
        self.most > self.least && now >= self.least
    }

    /// How long the loop may sleep before a tick may be due.
    pub fn until(&self, now: std::time::Instant) -> std::time::Duration {
        if now < self.least {
            self.least - now
        } else {
            self.most.saturating_duration_since(now)
        }
    }

    /// When the next tick is due at the latest.
    pub fn latest(&self) -> std::time::Instant {
        self.most
    }

    /// Whether a tick is due: at `most`, or from `least` on if a reply arrived (`answered`).
    pub fn due(&self, now: std::time::Instant, answered: bool) -> bool {
        now >= self.most || (answered && now >= self.least)
    }

    /// Spaces the next tick as `next` says, from now.
    pub fn schedule(&mut self, next: NextTick) {
        let end = std::time::Instant::now();
        self.least = end + std::time::Duration::from_micros(next.least_us);
        self.most = end + std::time::Duration::from_micros(next.most_us);
    }

    /// Runs a tick of `pager`'s schedule under `upkeep` (given to the pager first if it
    /// changed) and spaces the next one by its pacing.
    pub fn tick<T: Transport, D: Disk>(&mut self, pager: &mut Pager<T, D>, upkeep: &Upkeep) {
        if self.given != Some(upkeep.schedule) {
            pager.set_schedule(upkeep.schedule);
            self.given = Some(upkeep.schedule);
        }
        let started = std::time::Instant::now();
        let next = match pager.on_tick(real_time_us()) {
            Ok(tick) => {
                tick.report();
                upkeep
                    .pacing
                    .next(&tick, started.elapsed().as_micros() as u64)
            }
            Err(e) => {
                tracing::warn!("maintenance: {e}");
                NextTick {
                    least_us: upkeep.pacing.idle_us,
                    most_us: upkeep.pacing.idle_us,
                }
            }
        };
        self.schedule(next);
    }
}

#[cfg(test)]
mod ticker_tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn replies_count_only_between_least_and_most() {
        let mut t = Ticker::new();
        let now = Instant::now();
        assert!(t.due(now, false), "the first tick is due at once");
        t.schedule(NextTick {
            least_us: 50_000,
            most_us: 200_000,
        });
        let now = Instant::now();
        assert!(!t.listens(now) && !t.due(now, true), "before least");
        assert!(t.until(now) <= Duration::from_millis(50));
        let later = now + Duration::from_millis(60);
        assert!(t.listens(later) && t.due(later, true) && !t.due(later, false));
        assert!(t.until(later) <= Duration::from_millis(140));
        assert!(t.due(now + Duration::from_millis(201), false));
        t.schedule(NextTick {
            least_us: 1_000,
            most_us: 1_000,
        });
        assert!(!t.listens(Instant::now() + Duration::from_millis(2)));
    }
}
