//! What a pager is configured with: its backing (Markatos' flexible pager, paper 003 §2: remote
//! memory, local disk, or both), its cache and window sizes, and its redundancy scheme.

use crate::SealKey;
use netram_policy::redundancy::Scheme;
use std::fmt;

/// Where a pager keeps its pages (Markatos' flexibility, paper 003 §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backing {
    /// Remote memory; the local disk only when every server is full.
    #[default]
    Cluster,
    /// The local disk only: the baseline users compare with.
    Disk,
    /// Remote memory with a write-through copy on the local disk, so any server may die.
    ClusterDisk,
}

/// A backing the user wrote that is none of the three.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown backing {0:?}: expected cluster, disk or cluster+disk")]
pub struct ParseBackingError(pub String);

impl std::str::FromStr for Backing {
    type Err = ParseBackingError;
    fn from_str(s: &str) -> Result<Self, ParseBackingError> {
        match s {
            "cluster" => Ok(Self::Cluster),
            "disk" => Ok(Self::Disk),
            "cluster+disk" => Ok(Self::ClusterDisk),
            _ => Err(ParseBackingError(s.to_owned())),
        }
    }
}

impl fmt::Display for Backing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Cluster => "cluster",
            Self::Disk => "disk",
            Self::ClusterDisk => "cluster+disk",
        })
    }
}

#[derive(Debug, Clone)]
pub struct PagerConfig {
    /// Pages in this pager's region; page numbers run from 0 to `pages - 1`.
    pub pages: u64,
    /// The region number under which this pager's pages are stored on servers.
    pub region: u32,
    pub backing: Backing,
    /// Pages the local write-back cache holds (0: every read and write goes to its backing).
    pub cache_pages: usize,
    /// Dirty pages written back together when the cache must make room, so that write-backs
    /// are pipelined rather than paid one round trip at a time.
    pub writeback_batch: usize,
    /// Pages in flight per server at most; the server's announced window lowers it further.
    pub window: u32,
    /// Pages per GET or PUT frame at most: batching amortizes a frame's fixed costs (a system
    /// call and a wake-up on each side) over several pages.
    pub batch_max: usize,
    /// Seed of the placement's random choices.
    pub seed: u64,
    /// How pages survive the loss of servers (Markatos §2.1, Nswap §IV): `none`, `mirror:N`,
    /// `parity:N` or `rs:K+M`.
    pub redundancy: Scheme,
    /// Page buffers added for rebuilding under `rs:K+M` and `parity:N`, where one rebuilt
    /// piece takes K (N) pieces read: recovery works in waves, a round trip and (Reed-Solomon)
    /// a decoder's fixed cost per wave, so its rate grows with the wave (Nswap Table IV).
    /// 2048 slots are 8 MiB. Under `none` and `mirror:N` a quarter of them at most (512, 2
    /// MiB), for the waves of copies rebuilt and of pages moved off a server that shrank
    /// its offer (`migrate.rs`), whose rate grows with the wave too.
    pub recovery_slots: usize,
    /// Seal every page end to end under this key (`seal.rs`): servers and the network see
    /// only ciphertext, and a page that does not authenticate is never returned. The default
    /// is a fresh random key. `None`: pages travel in clear with their crc32c (development,
    /// or a network the operator trusts, and said so).
    pub seal: Option<SealKey>,
    /// Compress pages before they are sealed when the rule says it pays (`seal.rs`; MIRAGE+
    /// §3.4): the link's speed against the codec's cost. `None` (the default): never. It
    /// lets servers see how long each compressed page is; without a seal it does nothing.
    pub compress: Option<netram_proto::compress::Rule>,
    /// Under `none` and `mirror:N`, pages leave a shrinking server straight for another one
    /// (`handover.rs`); off, they pass through this pager (`migrate.rs`), as they always do
    /// under parity and Reed-Solomon.
    pub direct_migration: bool,
}

impl Default for PagerConfig {
    fn default() -> Self {
        Self {
            pages: 0,
            region: 0,
            backing: Backing::Cluster,
            cache_pages: 1024,
            writeback_batch: 32,
            window: 32,
            batch_max: 16,
            seed: 0x6e65_7472_616d,
            redundancy: Scheme::None,
            recovery_slots: 2048,
            seal: Some(SealKey::random()),
            compress: None,
            direct_migration: true,
        }
    }
}
