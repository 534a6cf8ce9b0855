//! netram's cluster policies as pure functions: no I/O, no clocks, randomness from a seeded
//! generator the caller owns, so the daemon, the tests and the simulator make the same choices.
//!
//! For now: placement, which server takes a new page (Distributed Anemone, paper 001, §2.6),
//! and prefetching, which pages a userfaultfd region fetches before they fault. Later issues add GMS epochs and weights, recovery planning and capacity control here.

pub mod placement;
pub mod prefetch;
