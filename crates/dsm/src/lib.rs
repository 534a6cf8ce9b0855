//! Distributed shared memory (MIRAGE+, paper 002; issue 40): processes on different machines
//! attach one named segment, and every load sees the latest store, whichever machine made it.
//!
//! This crate is the protocol, as state machines without I/O (DESIGN.md: the same code runs in
//! the daemon, in the model checker and in deterministic tests):
//!
//! - [`library`]: the segment's library site (its creator, §2.2): every request for a page
//!   comes here, is queued, and is served one at a time per page; it knows, per page, which
//!   site is the clock site (the one with the newest copy) and which sites hold copies.
//! - [`site`]: one machine's view of a segment's pages: the access it has to each (none,
//!   read, write), its faults turned into requests, and the library's orders (send your copy,
//!   drop it) carried out once the page's time window Δ has passed (§2.1).
//! - [`msg`]: what travels between them.
//!
//! Write-invalidate, one writer or many readers per page (§2.2): a read fault gets a copy
//! from the clock site (a writer is downgraded to a reader to send it); a write fault
//! invalidates every other copy first (an upgrade when the faulting site holds a copy, else
//! the clock site sends its copy and drops it). The library serves a page's next request only
//! when the current one is done (every invalidation acknowledged, the page installed), so the
//! directory it keeps is exact: that is what the model check (`tests/model.rs`, stateright)
//! verifies over every interleaving of three sites' faults, accesses, deliveries and windows.
//!
//! Crashes: a site's ([`Library::site_down`]: its copies dropped, a write copy on its way to
//! it given back, a page only it held reported lost) and the library's own
//! ([`Site::library_down`] reports what each survivor holds, [`Library::rebuild`] makes the
//! next library from the reports, in the next era of tickets).

pub mod library;
pub mod msg;
pub mod site;

pub use library::{Held, Library, Report};
pub use msg::{Access, Msg, PageNo, SiteId, Ticket, Want};
pub use site::{Fault, Site};
