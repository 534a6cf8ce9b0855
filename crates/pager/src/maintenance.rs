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

use crate::{Disk, Pager, PagerError, Transport};

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
}

impl Default for ScheduleConfig {
    fn default() -> Self {
        Self {
            probe_every_us: 2_000_000,
            reconnect_every_us: 1_000_000,
            recover_batch: 64,
            migrate_batch: 256,
        }
    }
}

/// When each task last ran; `None` before the first tick, which starts the clocks.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Schedule {
    pub(crate) cfg: ScheduleConfig,
    last_probe: Option<u64>,
    last_reconnect: Option<u64>,
}

/// What one tick did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tick {
    /// Replies that had arrived and were handled (write-backs finished while the program
    /// was elsewhere).
    pub replies: usize,
    /// Dead servers that answered again (empty: a new incarnation).
    pub revived: usize,
    /// Servers a probe found dead.
    pub found_dead: usize,
    /// Pages whose rebuild started, and pages found lost for good.
    pub rebuilt: usize,
    pub unrecoverable: usize,
    /// Pages whose move off a server that shrank its offer started.
    pub migrated: usize,
    /// Pages moving server to server after the tick, whose answers the next ticks take in.
    pub handing: usize,
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
    /// ([`Pager::poll`]), reconnecting dead servers, probing the live ones, one bounded step
    /// of recovery while pages lack copies, and one of migration while servers want pages
    /// moved ([`Pager::migrate`]). The first tick only starts the clocks. A failed task is
    /// returned; the tasks after it wait for the next tick.
    pub fn on_tick(&mut self, now_us: u64) -> Result<Tick, PagerError> {
        let cfg = self.schedule.cfg;
        let mut tick = Tick {
            replies: self.poll()?,
            ..Tick::default()
        };
        if Schedule::due(
            &mut self.schedule.last_reconnect,
            cfg.reconnect_every_us,
            now_us,
        ) {
            tick.revived = self.revive_dead_servers();
        }
        if Schedule::due(&mut self.schedule.last_probe, cfg.probe_every_us, now_us) {
            tick.found_dead = self.probe_servers()?;
        }
        if self.degraded_pages() > 0 {
            let step = self.recover(cfg.recover_batch)?;
            tick.rebuilt = step.started;
            tick.unrecoverable = step.unrecoverable;
        }
        if self.migration_due() {
            tick.migrated = self.migrate(cfg.migrate_batch)?.started;
        }
        tick.handing = self.pages_in_handover();
        Ok(tick)
    }
}
