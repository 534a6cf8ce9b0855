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
use netram_pager::Ticker;
pub use netram_pager::Upkeep;
use std::time::{Duration, Instant};

/// How long past its latest time a tick waits for the faults already raised to be served.
const DEFER_FOR_FAULTS: Duration = Duration::from_millis(2);

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
        if now < t.latest() + DEFER_FOR_FAULTS && self.fault_waiting() {
            return;
        }
        let mut st = self.lock();
        let Some(cfg) = st.upkeep else {
            return;
        };
        t.tick(&mut st.pager, &cfg);
        self.finish_fetches(&mut st);
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
