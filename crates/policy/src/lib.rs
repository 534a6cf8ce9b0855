//! netram's cluster policies as pure functions: no I/O, no clocks, randomness from a seeded
//! generator the caller owns, so the daemon, the tests and the simulator make the same choices.
//!
//! For now: placement, which server takes a new page (Distributed Anemone, paper 001, §2.6);
//! prefetching, which pages a userfaultfd region fetches before they fault (after Leap); and
//! the clock, which resident page of a region goes out next (GMS, paper 000, §4.2); and the
//! redundancy schemes' arithmetic (Markatos, Nswap); and the donor, how much memory a daemon
//! offers as its machine's own use of memory changes (Nswap, paper 004, §III); and global memory
//! management ([`gms`]: GMS's epochs, weights and MinAge, its directories, and N-chance
//! forwarding, paper 000, §3–5).

pub mod admission;
pub mod clock;
pub mod donor;
pub mod gms;
pub mod placement;
pub mod prefetch;
pub mod redundancy;
