//! How much memory a daemon offers to other machines, following its own machine's use of it:
//! Nswap's growing and shrinking cache (paper 004, §III: "when local processes need more RAM
//! space, the Nswap server releases pages from its Nswap Cache back to the local paging system;
//! when idle RAM becomes available, the server allocates some of it").
//!
//! A pure state machine: the daemon feeds it a [`Sample`] of the machine (MemAvailable from
//! `/proc/meminfo`, the memory pressure stall averages from `/proc/pressure/memory`, parsed here
//! by [`parse_meminfo`] and [`parse_psi`]) and of its own store (how much of the offer is used),
//! and gets back the offer to move to; the simulator and the tests feed it recorded and
//! synthetic traces.
//!
//! The rules, in the order they are checked:
//!
//! * **Never below the floor or above the ceiling** the operator set, in whole chunks.
//! * **Give back at once** when the machine needs its memory: when what it would have left
//!   once the offer filled up (MemAvailable minus the part of the offer not used yet, which
//!   is promised but not resident) falls under the reserve, or when programs stall on memory
//!   (PSI `some` avg10 above `shrink_pressure`). The offer shrinks by what restores the reserve
//!   (at least a chunk under pressure): local programs come first, and the pages in the chunks
//!   given back move to other nodes (migration, the daemon's part).
//! * **Grow slowly**: one chunk at a time, only after the machine has had at least two chunks
//!   to spare beyond the reserve, without pressure, for `grow_after_ms` — the band between
//!   "shrink" (under the reserve) and "grow" (two chunks above it) is the hysteresis that keeps
//!   an offer from flapping when a program's use hovers around the line.
//! * After a shrink, no growth for `grow_after_ms` either: memory that a program just claimed
//!   is likely to be claimed again.

use std::fmt;

/// What the operator sets.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DonorConfig {
    /// The offer never goes below this (bytes; rounded down to chunks).
    pub floor: u64,
    /// Nor above this (bytes; rounded down to chunks).
    pub ceiling: u64,
    /// The unit of growing and shrinking (bytes): the arena maps and gives back whole chunks.
    pub chunk: u64,
    /// MemAvailable kept for the machine's own programs, with the whole offer in use.
    pub reserve: u64,
    /// PSI memory `some` avg10 (percent) above which the offer shrinks.
    pub shrink_pressure: f32,
    /// PSI memory `some` avg10 (percent) above which the offer does not grow.
    pub grow_pressure: f32,
    /// How long room to grow must last before a chunk is added, and how long after a shrink
    /// nothing grows.
    pub grow_after_ms: u64,
}

impl DonorConfig {
    /// Defaults for a machine of `mem_total` bytes: offer between nothing and half of it, in
    /// 64 MiB chunks, keeping a tenth of the machine (at least 512 MiB) for its own programs.
    pub fn for_machine(mem_total: u64) -> Self {
        Self {
            floor: 0,
            ceiling: mem_total / 2,
            chunk: 64 << 20,
            reserve: (mem_total / 10).max(512 << 20),
            shrink_pressure: 10.0,
            grow_pressure: 1.0,
            grow_after_ms: 5_000,
        }
    }

    fn round(&self, bytes: u64) -> u64 {
        bytes / self.chunk * self.chunk
    }

    /// The configuration's contradictions, for `--check-config` and the daemon's start.
    pub fn check(&self) -> Result<(), DonorConfigError> {
        if self.chunk == 0 {
            return Err(DonorConfigError(
                "the chunk must be larger than zero".into(),
            ));
        }
        if self.round(self.floor) > self.round(self.ceiling) {
            return Err(DonorConfigError(format!(
                "the floor ({} bytes) is above the ceiling ({} bytes)",
                self.floor, self.ceiling
            )));
        }
        if self.grow_pressure > self.shrink_pressure {
            return Err(DonorConfigError(format!(
                "growing is allowed up to a pressure ({}%) above the one that shrinks ({}%)",
                self.grow_pressure, self.shrink_pressure
            )));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("donor configuration: {0}")]
pub struct DonorConfigError(String);

/// The machine and the store, as the daemon reads them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    pub now_ms: u64,
    /// `MemAvailable` of `/proc/meminfo`, bytes.
    pub mem_available: u64,
    /// PSI memory `some` avg10, percent (0 where the kernel has no PSI).
    pub pressure: f32,
    /// Bytes of the offer holding pages (resident: already out of MemAvailable).
    pub used: u64,
}

/// Why the offer changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The machine had room to spare for long enough.
    Room,
    /// Filling the offer would leave the machine less than its reserve.
    Reserve,
    /// Programs stall on memory.
    Pressure,
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Reason::Room => "room to spare",
            Reason::Reserve => "the machine needs its memory",
            Reason::Pressure => "memory pressure",
        })
    }
}

/// A change of the offer: grow or shrink to `to` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Change {
    pub to: u64,
    pub reason: Reason,
}

/// The controller.
#[derive(Debug, Clone)]
pub struct Donor {
    cfg: DonorConfig,
    offered: u64,
    /// Since when the machine has had room to grow (none while it has not).
    room_since: Option<u64>,
    /// When the offer last shrank.
    shrunk_at: Option<u64>,
}

impl Donor {
    /// Starts at the floor: the offer grows as the machine shows it has room.
    pub fn new(cfg: DonorConfig) -> Result<Self, DonorConfigError> {
        cfg.check()?;
        Ok(Self {
            offered: cfg.round(cfg.floor),
            cfg,
            room_since: None,
            shrunk_at: None,
        })
    }

    /// The bytes offered now.
    pub fn offered(&self) -> u64 {
        self.offered
    }

    pub fn config(&self) -> &DonorConfig {
        &self.cfg
    }

    /// Takes one sample; returns the change to make, if any (the offer is already `to`).
    pub fn sample(&mut self, s: Sample) -> Option<Change> {
        let cfg = self.cfg;
        let floor = cfg.round(cfg.floor);
        let ceiling = cfg.round(cfg.ceiling);
        // What the machine would have left with the whole offer in use: the unused part of
        // the offer is promised, not yet resident; pages held beyond the offer (a shrink whose
        // pages are still migrating away) will be given back.
        let promised = self.offered.saturating_sub(s.used);
        let leaving = s.used.saturating_sub(self.offered);
        let left = (s.mem_available + leaving).saturating_sub(promised);
        let shortfall = cfg.reserve.saturating_sub(left);
        let pressed = s.pressure > cfg.shrink_pressure;
        if (shortfall > 0 || pressed) && self.offered > floor {
            let give = shortfall.div_ceil(cfg.chunk).max(1) * cfg.chunk;
            let to = self.offered.saturating_sub(give).max(floor);
            self.offered = to;
            self.room_since = None;
            self.shrunk_at = Some(s.now_ms);
            let reason = if shortfall > 0 {
                Reason::Reserve
            } else {
                Reason::Pressure
            };
            return Some(Change { to, reason });
        }
        let room = left >= cfg.reserve + 2 * cfg.chunk
            && s.pressure <= cfg.grow_pressure
            && self.offered + cfg.chunk <= ceiling;
        if !room {
            self.room_since = None;
            return None;
        }
        let since = *self.room_since.get_or_insert(s.now_ms);
        let calm = self
            .shrunk_at
            .is_none_or(|t| s.now_ms.saturating_sub(t) >= cfg.grow_after_ms);
        if s.now_ms.saturating_sub(since) < cfg.grow_after_ms || !calm {
            return None;
        }
        self.offered += cfg.chunk;
        // The next chunk waits as long again.
        self.room_since = Some(s.now_ms);
        Some(Change {
            to: self.offered,
            reason: Reason::Room,
        })
    }
}

/// `MemTotal` and `MemAvailable` of `/proc/meminfo`, in bytes.
pub fn parse_meminfo(text: &str) -> Option<(u64, u64)> {
    let field = |name: &str| {
        text.lines().find_map(|l| {
            let rest = l.strip_prefix(name)?.strip_prefix(':')?;
            let kb = rest.trim().strip_suffix("kB")?.trim();
            kb.parse::<u64>().ok().map(|k| k * 1024)
        })
    };
    Some((field("MemTotal")?, field("MemAvailable")?))
}

/// The `some` avg10 of `/proc/pressure/memory`, percent.
pub fn parse_psi(text: &str) -> Option<f32> {
    let line = text.lines().find(|l| l.starts_with("some "))?;
    line.split_whitespace()
        .find_map(|w| w.strip_prefix("avg10="))?
        .parse()
        .ok()
}

#[cfg(test)]
#[path = "donor_tests.rs"]
mod tests;
