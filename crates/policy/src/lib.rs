//! netram's cluster policies as pure functions: no I/O, no clocks, randomness from a seeded
//! generator the caller owns, so the daemon, the tests and the simulator make the same choices.
//!
//! For now this is placement: which server takes a new page (Distributed Anemone, paper 001,
//! §2.6). Later issues add GMS epochs and weights, recovery planning and capacity control here.

pub mod placement;
