//! The cluster-wide algorithms at scale (GMS §5.5–5.6, Table 5; issue 39): the production
//! state machines of `netram_policy::gms` driven on one thread with a virtual clock, over
//! hundreds to tens of thousands of simulated nodes, against N-chance forwarding and a hashed
//! data cache on the same workloads.
//!
//! [`cluster`] is the simulated cluster, [`workload`] what its nodes do, [`experiments`] the
//! paper's figures as runs of it.

pub mod cluster;
pub mod experiments;
pub mod workload;

pub use cluster::{run, Algorithm, Config, Costs, Outcome};
