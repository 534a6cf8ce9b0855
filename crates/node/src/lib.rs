//! netram's runtime: the thin layer that moves bytes and time in and out of the I/O-free state
//! machines (`netram-store` on the server, `netram-pager` on the client).
//!
//! * [`server`]: the page server daemon (`netram serve`), Distributed Anemone's server module
//!   (paper 001, §2.1) and Nswap's per-node cache of remote pages (paper 004, §III);
//! * [`client`]: the TCP [`netram_pager::Transport`], with soft-state refresh (Anemone §2.5);
//! * [`disk`]: the local spill file behind [`netram_pager::Disk`] (Markatos, paper 003);
//! * [`latency`]: the low-latency mode (PM QoS request, adaptive polling);
//! * [`open`]: a client pager from servers, backing, size and redundancy, for every front end;
//! * [`peers`]: server-to-server connections that carry parity deltas to holders (Nswap
//!   §IV-B2 and IV-C);
//! * [`maintain`]: the background thread that probes servers, reconnects them and runs
//!   recovery at a bounded rate (Nswap §IV-B3);
//! * [`pressure`]: locking memory and PR_SET_IO_FLUSHER for a process that serves swap.
//!
//! # Why threads and blocking sockets, not an async runtime
//!
//! On the VMs we run on, a hand-off to a sleeping thread on the other vCPU costs ~60 µs, about
//! as much as the whole loopback round trip (`../shared/MACHINE-NOTES.md`). So the critical path
//! has no hand-off at all: the pager's calling thread writes requests to the socket and reads the
//! replies itself, and the server answers on the thread that read the request, with the store's
//! lock taken once per batch of frames. Pipelining comes from writing many frames per `write`
//! and reading many per `read`, not from more threads. The cost is a thread per connection on
//! the server, bounded by `max_connections`.
//!
//! Measured side by side (`netram bench core`, the same 32 B → 4 KiB exchange): with the PM QoS
//! request held, blocking threads that poll briefly answer in ~10 µs and tokio (multi-thread
//! server, current-thread client) in 15–19 µs, so in the low-latency mode threads win. In the
//! default mode tokio measured *faster* (~44 µs against ~90 µs): its extra runtime threads keep
//! the vCPUs out of deep idle, the same effect as spreading requests over three server threads.
//! That is an idle-state artefact rather than less work, and the low-latency mode removes it
//! more cheaply, but it is real and recorded in `bench-results/core.md`.

pub mod client;
pub mod disk;
mod framing;
pub mod latency;
pub mod maintain;
pub mod open;
pub mod peers;
pub mod pressure;
pub mod server;
