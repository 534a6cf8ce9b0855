//! The low-latency mode.
//!
//! On these VMs an idle vCPU halts, and waking it costs ~60 µs: more than the loopback network
//! path (`../shared/MACHINE-NOTES.md`). Two remedies, both used in the low-latency mode:
//!
//! * [`PmQos`]: hold a PM QoS request for zero wake-up latency by keeping `/dev/cpu_dma_latency`
//!   open with 0 written to it (the kernel keeps idle CPUs out of deep idle states while it is
//!   open; closing it drops the request). Needs root; without it the mode falls back to polling;
//! * adaptive polling ([`DEFAULT_SPIN`]): before sleeping in `read`, poll the socket without
//!   blocking for a short while, so that a reply that comes soon is taken without any wake-up.
//!   Adaptive per connection: a connection polls next time only if its last wait was shorter
//!   than the spin (`FrameBuffer::fill`), so one whose data comes rarely sleeps at once.
//!   It costs CPU only while a request is outstanding or just answered, at most the spin time
//!   per request. Polling threads must not outnumber CPUs: a thread that polls holds the CPU
//!   that the thread it waits for may need (measured with three servers and a client in one
//!   process on 2 vCPUs: GET p50 55 µs with every thread polling, 18 µs with a budget). So
//!   a thread polls only while it holds one of [`PollToken`]'s per-process tokens, one per CPU.

use std::fs::File;
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// How long a thread polls its socket before it sleeps, in the low-latency mode: a few
/// round trips' worth, so a depth-1 exchange never sleeps, while an idle connection costs at most
/// this much CPU after its last message.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);

/// A held PM QoS request; dropping it releases the request.
#[derive(Debug)]
pub struct PmQos {
    _file: File,
}

impl PmQos {
    /// Asks the kernel for zero CPU wake-up latency. `None` (with the reason logged at debug
    /// level) when `/dev/cpu_dma_latency` cannot be opened, e.g. without root.
    pub fn hold() -> Option<Self> {
        let mut f = match File::options().write(true).open("/dev/cpu_dma_latency") {
            Ok(f) => f,
            Err(e) => {
                tracing::debug!("no PM QoS request: /dev/cpu_dma_latency: {e}");
                return None;
            }
        };
        // The interface takes a native-endian s32; 0 reads the same in any byte order.
        match f.write_all(&0i32.to_ne_bytes()) {
            Ok(()) => Some(Self { _file: f }),
            Err(e) => {
                tracing::debug!("no PM QoS request: write: {e}");
                None
            }
        }
    }
}

static POLLERS: AtomicUsize = AtomicUsize::new(0);
static DENIED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How often a thread wanted to poll but found every token taken, since the process started.
pub fn polls_denied() -> u64 {
    DENIED.load(Ordering::Relaxed)
}

/// Reads the polling budget now (its environment variable and `/sys`), so that no later poll
/// does: a region's fault handler must never read the environment, which a program may have
/// moved into its heap — on the region (perl does) — and the handler would fault on it and wait
/// for itself. `netram_client::TcpTransport::connect` calls this.
pub fn prepare_polling() {
    let _ = poll_budget();
}

/// One polling thread per online CPU. Not `available_parallelism()`: that follows the calling
/// thread's affinity, so a thread pinned to one CPU would set the budget of the whole process to
/// one (measured: a context switch per GET, 15 µs instead of 10).
fn poll_budget() -> usize {
    static BUDGET: OnceLock<usize> = OnceLock::new();
    *BUDGET.get_or_init(|| {
        if let Some(n) = std::env::var("NETRAM_POLL_BUDGET")
            .ok()
            .and_then(|v| v.parse().ok())
        {
            return n;
        }
        std::fs::read_to_string("/sys/devices/system/cpu/online")
            .ok()
            .and_then(|s| online_cpus(&s))
            .unwrap_or_else(|| {
                std::thread::available_parallelism()
                    .map(|n| n.get())
                    .unwrap_or(1)
            })
    })
}

/// Counts the CPUs in a kernel CPU list such as `0-3,8,10-11`.
fn online_cpus(list: &str) -> Option<usize> {
    let mut n = 0;
    for part in list.trim().split(',') {
        n += match part.split_once('-') {
            Some((a, b)) => {
                b.parse::<usize>()
                    .ok()?
                    .checked_sub(a.parse::<usize>().ok()?)?
                    + 1
            }
            None => {
                part.parse::<usize>().ok()?;
                1
            }
        };
    }
    (n > 0).then_some(n)
}

#[cfg(test)]
mod tests {
    #[test]
    fn cpu_lists_are_counted() {
        assert_eq!(super::online_cpus("0-1\n"), Some(2));
        assert_eq!(super::online_cpus("0"), Some(1));
        assert_eq!(super::online_cpus("0-3,8,10-11"), Some(7));
        assert_eq!(super::online_cpus("garbage"), None);
        assert_eq!(super::online_cpus("3-1"), None);
    }
}

/// Permission for one thread to poll instead of sleeping; released on drop.
#[derive(Debug)]
pub struct PollToken(());

impl PollToken {
    /// A token if fewer threads of this process than it has CPUs are polling.
    pub fn try_take() -> Option<Self> {
        let budget = poll_budget();
        POLLERS
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < budget).then_some(n + 1)
            })
            .map(|_| PollToken(()))
            .map_err(|_| DENIED.fetch_add(1, Ordering::Relaxed))
            .ok()
    }
}

impl Drop for PollToken {
    fn drop(&mut self) {
        POLLERS.fetch_sub(1, Ordering::AcqRel);
    }
}
