//! Distributed shared memory at run time (MIRAGE+, paper 002; issue 40): segments that
//! processes on different machines map and use with plain loads and stores, kept coherent by
//! [`netram_dsm`]'s protocol.
//!
//! - [`memory`]: a machine's one copy of a segment (a memfd every local process maps) and how
//!   each process's page tables are made to follow the protocol (userfaultfd: missing faults
//!   for pages not here, write protection for pages only readable here).
//! - [`agent`]: the machine's agent, one thread: serves the local processes' faults, carries
//!   out the library's orders on the copy, is the library site of the segments created here,
//!   and talks to the other machines' agents through a seam (a frame for a site).
//! - [`wire`]: the protocol's messages to and from frames.
//! - [`local`]: between a process and its machine's agent (the daemon's shared-memory
//!   socket), and [`Segment`], what a program holds.
//!
//! From a fault to a page and back: a thread of a process touches a page this machine does
//! not hold → its userfaultfd reports the fault to the agent → [`netram_dsm::Site::fault`]
//! asks the library → the library orders the clock site to send the page → that machine's
//! agent write-protects it in its processes, reads it from its memfd and sends it → this
//! agent writes it into its memfd, makes it writable if it is the write copy, and wakes the
//! thread, whose access now finds the page.

pub mod agent;
pub mod local;
pub mod memory;
pub mod wire;

pub use agent::{Agent, AgentError, Counters, Door, Found, LookupResult, Role, Running, SegmentId};
pub use local::{Segment, SegmentError};
pub use memory::{Copy, Mapped, View};
pub use wire::Meta;
