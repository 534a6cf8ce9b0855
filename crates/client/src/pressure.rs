//! Making a swap device's own process safe under memory pressure.
//!
//! A process that serves the kernel's swap must not itself wait for memory the kernel can only
//! free by swapping through it: that is a deadlock of the machine it is meant to save. So the
//! process locks its memory (nothing of it can be swapped out), and marks itself an I/O flusher
//! (`PR_SET_IO_FLUSHER`: its allocations do not recurse into reclaim that waits on I/O). The
//! buffers it needs per page are allocated at start (the pager's slots); what is in flight is
//! bounded (the pager's credit window, the NBD pipeline limit).

use rustix::mm::MlockAllFlags;
use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};

/// What [`prepare_for_swap`] managed, and why not where it did not.
#[derive(Debug)]
pub struct Hardening {
    pub memory_locked: Result<(), HardenError>,
    pub io_flusher: Result<(), HardenError>,
}

/// Why a process that serves swap could not be made safe under memory pressure.
#[derive(Debug, Clone, thiserror::Error)]
pub enum HardenError {
    #[error("RLIMIT_MEMLOCK is {0} bytes; run as root or raise it (ulimit -l unlimited)")]
    MemlockLimit(u64),
    #[error("mlockall: {0}")]
    Mlock(rustix::io::Errno),
    #[error("PR_SET_IO_FLUSHER: {0} (needs CAP_SYS_RESOURCE)")]
    IoFlusher(rustix::io::Errno),
}

/// Locks all present and future memory of this process and marks it an I/O flusher, where the
/// process is allowed to (both need root or the matching capability and limits).
pub fn prepare_for_swap() -> Hardening {
    // Root may lift its own limit (distributions set 8 MiB even for root).
    let _ = setrlimit(
        Resource::Memlock,
        Rlimit {
            current: None,
            maximum: None,
        },
    );
    let memory_locked = match getrlimit(Resource::Memlock).current {
        // With a finite limit, MCL_FUTURE would make later allocations fail, and a failed
        // allocation aborts the process: worse than not locking. CAP_IPC_LOCK lifts the limit.
        Some(limit) if !has_ipc_lock() => Err(HardenError::MemlockLimit(limit)),
        _ => rustix::mm::mlockall(MlockAllFlags::CURRENT | MlockAllFlags::FUTURE)
            .map_err(HardenError::Mlock),
    };
    let io_flusher =
        rustix::process::configure_io_flusher_behavior(true).map_err(HardenError::IoFlusher);
    Hardening {
        memory_locked,
        io_flusher,
    }
}

/// Whether this process has CAP_IPC_LOCK (bit 14 of the effective set), which exempts it from
/// RLIMIT_MEMLOCK.
fn has_ipc_lock() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("CapEff:"))?;
            u64::from_str_radix(line.split_whitespace().nth(1)?, 16).ok()
        })
        .is_some_and(|caps| caps & (1 << 14) != 0)
}
