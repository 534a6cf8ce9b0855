//! netram's deterministic simulator (TigerBeetle's VOPR, FoundationDB's simulation; STYLE.md
//! examples 7 and 8): a whole cluster on one thread, with a virtual clock.
//!
//! The code under test is the production code: every server is a real `netram_store::Store`
//! answering through `netram_store::serve`, every client a real `netram_pager::Pager` whose
//! transport is the simulated network ([`transport::SimTransport`]). The network delays,
//! loses, duplicates and reorders messages and partitions clients from servers; servers crash
//! (their RAM is lost), restart empty with a new incarnation, and slow down
//! ([`world::World`]). Everything comes from one seed, so a failing run is replayed exactly by
//! the command it prints.
//!
//! The checkers ([`check`]) live outside the code under test and run after every step: a page
//! reads back with the contents last written to it, unless more of the servers it relied on
//! have failed than its redundancy tolerates (then the read may fail, never return wrong
//! data); every written page has a holder, and the holder's store really has its current
//! version; no store holds more than its capacity or breaks its own accounting; and after
//! the clients end their sessions, nothing is left on any server. Nswap §IV (paper 004) is the
//! reliability model being checked.

pub mod check;
pub mod gms;
pub mod scenario;
pub mod transport;
pub mod world;

pub use scenario::{run, Failure, Report, Scenario};
