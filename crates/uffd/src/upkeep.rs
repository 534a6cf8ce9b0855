//! The pager's maintenance schedule run by the region's handler thread, between faults: probes,
//! reconnections and recovery while the program runs (Nswap §IV-B3), moves off a donor whose
//! offer shrank (Nswap §III). One loop owns the region's userfaultfd, its children's, the
//! pager's connections and the schedule's timers, so that a fault never waits for another
//! thread to let go of the region's lock, and the schedule's answers are taken in by the same
//! poll that waits for faults.
//!
//! What is due when is the pager's (`Pager::on_tick`, the same schedule the simulator runs on
//! virtual time); how ticks are spaced, so that maintenance takes a bounded share of the
//! handler, is `netram_pager::Pacing`, shared with the maintenance thread of the front ends
//! that have no loop of their own (`netram_client::maintain`). Asking the local daemon about
//! membership is a blocking call and stays on a thread of its own
//! (`netram_client::maintain::spawn_membership`).

use super::*;
use netram_pager::{NextTick, Pacing, ScheduleConfig};
use std::time::{Duration, Instant};

/// What the handler runs of the pager's maintenance schedule ([`RegionOptions::upkeep`],
/// [`Region::set_upkeep`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Upkeep {
    pub schedule: ScheduleConfig,
    pub pacing: Pacing,
}

/// How long past its latest time a tick waits for the faults already raised to be served.
const DEFER_FOR_FAULTS: Duration = Duration::from_millis(2);

/// When the handler's loop ticks next: not before `least` (the program's share of the
/// handler), at `most` at the latest, and in between as soon as a reply arrives when moves or
/// recovery wait for answers.
pub(crate) struct Ticker {
    /// The schedule last given to the pager.
    given: Option<ScheduleConfig>,
    least: Instant,
    most: Instant,
}

impl Ticker {
    pub(crate) fn new() -> Self {
        let now = Instant::now();
        Self {
            given: None,
            least: now,
            most: now,
        }
    }

    /// Whether replies arriving now are worth a tick.
    pub(crate) fn listens(&self, now: Instant) -> bool {
        self.most > self.least && now >= self.least
    }

    /// How long the loop may sleep before a tick may be due.
    pub(crate) fn until(&self, now: Instant) -> Duration {
        if now < self.least {
            self.least - now
        } else {
            self.most.saturating_duration_since(now)
        }
    }

    fn due(&self, now: Instant, answered: bool) -> bool {
        now >= self.most || (answered && now >= self.least)
    }

    fn schedule(&mut self, next: NextTick) {
        let end = Instant::now();
        self.least = end + Duration::from_micros(next.least_us);
        self.most = end + Duration::from_micros(next.most_us);
    }
}

impl<T: Transport, D: Disk> Shared<T, D> {
    /// Whether the handler runs the schedule (read without the lock by the loop).
    pub(crate) fn upkeep_on(&self) -> bool {
        self.upkeep_on.load(Ordering::Acquire)
    }

    /// Whether a fault (or another event) waits on the region's userfaultfd.
    fn fault_waiting(&self) -> bool {
        sys::readable_within(&self.uffd, std::time::Duration::ZERO)
    }

    /// Runs a tick of the schedule if one is due: at the ticker's `most`, or from its `least`
    /// on if a reply arrived (`answered`). The replies the tick reads finish fetches too.
    pub(crate) fn upkeep(&self, t: &mut Ticker, answered: bool) {
        let now = Instant::now();
        if !self.upkeep_on() || !t.due(now, answered) {
            return;
        }
        // The program's faults first: a tick waits for those already raised, a little.
        if now < t.most + DEFER_FOR_FAULTS && self.fault_waiting() {
            return;
        }
        let mut st = self.lock();
        let Some(cfg) = st.upkeep else {
            return;
        };
        if t.given != Some(cfg.schedule) {
            st.pager.set_schedule(cfg.schedule);
            t.given = Some(cfg.schedule);
        }
        let started = Instant::now();
        let next = match st.pager.on_tick(netram_pager::real_time_us()) {
            Ok(tick) => {
                tick.report();
                cfg.pacing.next(&tick, started.elapsed().as_micros() as u64)
            }
            Err(e) => {
                tracing::warn!("maintenance: {e}");
                NextTick {
                    least_us: cfg.pacing.idle_us,
                    most_us: cfg.pacing.idle_us,
                }
            }
        };
        self.finish_fetches(&mut st);
        drop(st);
        t.schedule(next);
    }
}

impl<T: Transport, D: Disk> Region<T, D> {
    /// Has the handler run the pager's maintenance schedule (`None`: stop running it).
    pub fn set_upkeep(&self, upkeep: Option<Upkeep>) {
        self.shared.lock().upkeep = upkeep;
        self.shared
            .upkeep_on
            .store(upkeep.is_some(), Ordering::Release);
        // The loop may be asleep with no deadline.
        let _ = rustix::io::write(&*self.stop, &handler::WAKE.to_ne_bytes());
    }
}

#[cfg(test)]
mod ticker_tests {
    use super::*;

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
