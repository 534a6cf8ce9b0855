//! The client pager: where a client's pages are, and the machinery that moves them.
//!
//! It implements the client module of Distributed Anemone (paper 001, §2.1: page table, LRU
//! write-back cache, mapping of pages to servers; §2.6 load balancing), the flexible backing
//! store of Markatos' pager (paper 003: remote memory, local disk, or both), and Nswap's client
//! side (paper 004, §III: versions on every page-out, garbage collection of dead pages).
//!
//! The pager owns no socket and no file. It drives a [`Transport`] (TCP in the daemon, a
//! simulated network in tests and in the simulator) and a [`Disk`] (a spill file in the daemon,
//! memory in tests), so everything it decides can be tested deterministically.
//!
//! # Where things are
//!
//! * `pager/`: the machinery, under whatever scheme runs: `mod.rs`, the pager's state, its
//!   public operations (write, flush, discard), probing and reviving servers, and beside it
//!   `cache.rs`, `read.rs`, `ticket.rs`, `writeback.rs`, `requests.rs`, `reply.rs`,
//!   `migrate.rs`, `handover.rs`, `maintenance.rs`, `seal.rs`, `invariants.rs` (below);
//! * `table.rs`: the page table: per page, its version, the servers that hold it and whether
//!   the local disk holds its current version;
//! * `cache.rs`: the slot pool, `cache_pages + staging` page buffers allocated once at start,
//!   and the LRU write-back cache over it. Every byte a page moves through lives in a slot, so
//!   completing a request never needs a caller's buffer and nothing is allocated per page;
//! * `read.rs`: reads, from the cache, a holder, another copy, the disk, or reconstruction;
//! * `ticket.rs`: reads by ticket ([`Pager::start_read`], [`Pager::take_finished`]): started
//!   without waiting, finished by whatever hands the pager its replies, so that a loop that owns
//!   the sockets keeps many in flight (the userfaultfd handler's fetches);
//! * `writeback.rs`: a page leaving the cache until every copy is acknowledged;
//! * `requests.rs`: requests in flight, bounded per server by the credit window the server
//!   announced (Anemone's RMAP window), and the per-server queues of those waiting for credits;
//! * `reply.rs`: how the world reaches the pager ([`Pager::on_reply`], [`Pager::on_failure`])
//!   and what a reply does;
//! * `scheme/`: redundancy behind one seam, beside `pager/`: a type per scheme implementing
//!   one trait (`mirror.rs` for `none` and `mirror:N`, `parity/` for `parity:N`, `stripe/` for
//!   Reed-Solomon, each with its recovery in `recover.rs`);
//! * `maintenance.rs`: probes, reconnects and recovery on the clock it is told
//!   ([`Pager::on_tick`]); `invariants.rs`: [`Pager::check_invariants`];
//! * placement ([`netram_policy::placement`]): two weighted random choices by free capacity
//!   and load; a FULL refusal (Anemone's NACK) sends the page to another server, and when no
//!   server is left it spills to the local disk (Markatos).
//!
//! Replies may come back in any order. The world reaches the pager through `on_reply`,
//! `on_failure` and `on_tick` (or `poll`, which reads what has arrived); reads by ticket never
//! wait; the other operations (write-back when slots run out, flush, discard, recovery,
//! migration) still wait for their replies themselves (through its [`Transport`]), and hand
//! what they read to the same code.
//!
//! # Failures it guards against
//!
//! A server that disconnects, errs or times out is marked dead; requests in flight to it are
//! failed over: writes go to another server (the data is still in its slot), reads come from the
//! disk copy with `cluster+disk` backing or fail with [`PagerError::Lost`] naming the server and
//! the pages. A page whose checksum or version does not match is never returned as data.

mod config;
mod counters;
mod error;
mod pager;
mod scheme;
mod table;
mod transport;

pub use config::{Backing, PagerConfig, ParseBackingError};
pub use counters::PagerCounters;
pub use error::{LostPages, PagerError};
pub use netram_policy::redundancy::{ParseSchemeError, Scheme};
use netram_proto::{Request, PAGE_SIZE};
pub use pager::maintenance::{
    real_time_us, NextTick, Pacing, ScheduleConfig, Tick, Ticker, Upkeep,
};
pub use pager::migrate::MigrationStep;
pub(crate) use pager::{handover, read, requests, seal, ticket, writeback};
pub use pager::{Flush, PageLocation, Pager, Pieces};
pub(crate) use pager::{Op, ServerState, STRIPE_LOST};
pub use scheme::RecoveryStep;
pub use seal::{SealKey, SEAL_KEY_LEN, SEAL_TAG_LEN};
pub use transport::{Disk, MemDisk, ServerInfo, Transport, TransportError};
