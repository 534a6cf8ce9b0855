//! The daemon's side of a donor that follows its machine (Nswap's growing and shrinking cache,
//! paper 004, §III): every [`TICK`] it reads MemAvailable and memory pressure from `/proc`,
//! asks the I/O-free controller (`netram_policy::donor`) how much to offer, moves the store's
//! offer there (`Store::set_offer`), and gives the memory of the frames no longer offered back
//! to the kernel (`MADV_DONTNEED`: the daemon's resident memory falls).
//!
//! Pages held above a shrunk offer are first moved down into frames free below it
//! (`Store::compact`); what does not fit stays readable (`pages_beyond_offer`) while every
//! reply tells its owner how many must leave, and the owners move them to other nodes
//! (`netram-pager`'s `migrate.rs`); their frames are given back as they go. Nswap's direct
//! move (MIGRATE from this node to another, UPDATE to the owner, INVALIDATE here) is not done:
//! the pages travel through their owner.

use netram_policy::donor::{parse_meminfo, parse_psi, Donor, DonorConfig, Sample};
use netram_proto::PAGE_SIZE;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How often the machine is looked at.
pub const TICK: Duration = Duration::from_millis(250);

/// Where the machine is read from (`/proc`, or a directory of test files).
#[derive(Debug, Clone, PartialEq)]
pub struct AdaptConfig {
    pub donor: DonorConfig,
    pub proc_dir: PathBuf,
}

/// MemAvailable (bytes) and the pressure (percent; 0 where the kernel has no PSI).
pub fn read_machine(proc_dir: &Path) -> std::io::Result<(u64, u64, f32)> {
    let meminfo = std::fs::read_to_string(proc_dir.join("meminfo"))?;
    let (total, available) = parse_meminfo(&meminfo).ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "no MemTotal or MemAvailable in meminfo",
        )
    })?;
    let pressure = std::fs::read_to_string(proc_dir.join("pressure/memory"))
        .ok()
        .and_then(|t| parse_psi(&t))
        .unwrap_or(0.0);
    Ok((total, available, pressure))
}

/// The controller and what it last decided, for the daemon's loop.
#[derive(Debug)]
pub struct Adapter {
    donor: Donor,
    proc_dir: PathBuf,
    warned: bool,
}

impl Adapter {
    pub fn new(cfg: &AdaptConfig) -> Result<Self, netram_policy::donor::DonorConfigError> {
        Ok(Self {
            donor: Donor::new(cfg.donor)?,
            proc_dir: cfg.proc_dir.clone(),
            warned: false,
        })
    }

    /// The offer to start with, in frames.
    pub fn offered_frames(&self) -> u64 {
        self.donor.offered() / PAGE_SIZE as u64
    }

    /// One look at the machine, with `used` bytes of the store holding pages; the new offer
    /// in frames when it changed.
    pub fn tick(&mut self, now_ms: u64, used: u64) -> Option<u64> {
        let (_, mem_available, pressure) = match read_machine(&self.proc_dir) {
            Ok(m) => m,
            Err(e) => {
                if !self.warned {
                    tracing::error!(
                        dir = %self.proc_dir.display(),
                        "cannot read the machine's memory, the offer stays where it is: {e}"
                    );
                    self.warned = true;
                }
                return None;
            }
        };
        let change = self.donor.sample(Sample {
            now_ms,
            mem_available,
            pressure,
            used,
        })?;
        tracing::info!(
            offer_bytes = change.to,
            mem_available,
            pressure,
            "offer changed: {}",
            change.reason
        );
        Some(change.to / PAGE_SIZE as u64)
    }
}
