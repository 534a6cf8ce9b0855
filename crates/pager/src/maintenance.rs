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
    /// A probe not answered within this long (µs) fails its server: the transport's reply
    /// timeout, for a probe nobody waits for.
    pub probe_timeout_us: u64,
}

impl Default for ScheduleConfig {
    fn default() -> Self {
        Self {
            probe_every_us: 2_000_000,
            reconnect_every_us: 1_000_000,
            recover_batch: 64,
            migrate_batch: 256,
            probe_timeout_us: 5_000_000,
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
    /// `probe_timeout_us`. (Waiting held the pager, and its owner's lock, for every reply in
    /// flight, and for the whole reply timeout when a server hung.)
    pub fn on_tick(&mut self, now_us: u64) -> Result<Tick, PagerError> {
        let cfg = self.schedule.cfg;
        let mut tick = Tick {
            replies: self.poll()?,
            ..Tick::default()
        };
        let dead_before = self.counters.servers_dead;
        self.check_probes(now_us);
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
        tick.rebuilding =
            self.rebuilding.len() + self.scheme.stripe().map_or(0, |rs| rs.rebuilding());
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

    /// Forgets the probes answered (or whose server failed meanwhile), and fails the servers
    /// whose probe has waited `probe_timeout_us`.
    fn check_probes(&mut self, now_us: u64) {
        let timeout = self.schedule.cfg.probe_timeout_us;
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
