//! The page server daemon (`netram serve`): Distributed Anemone's server module (paper 001,
//! §2.1) and Nswap's per-node cache of remote pages (paper 004, §III), around the I/O-free
//! `netram-store`.
//!
//! * [`daemon`]: accepting connections, serving their frames against the store, its limits;
//! * [`donor`]: the offer that follows the machine's own use of memory (Nswap §III);
//! * [`gossip`]: membership (SWIM) over UDP, signed with the node's certificate, and the
//!   resource announcements that ride on it (Anemone §2.4);
//! * `http`: `/metrics` (Prometheus) and `/members` for operators and local clients;
//! * [`peers`]: server-to-server connections that carry parity deltas to holders (Nswap
//!   §IV-B2 and IV-C).
//! * [`shm`]: distributed shared memory's agent (MIRAGE+), its links to other daemons and
//!   the local socket where processes create and attach segments.
//!
//! # Why threads and blocking sockets, not an async runtime
//!
//! On the VMs we run on, a hand-off to a sleeping thread on the other vCPU costs ~60 µs, about
//! as much as the whole loopback round trip (`../shared/MACHINE-NOTES.md`). So the critical path
//! has no hand-off at all: the client's calling thread writes requests to the socket and reads
//! the replies itself (`netram-client`), and the server answers on the thread that read the
//! request, with the store's lock taken once per batch of frames. Pipelining comes from writing
//! many frames per `write` and reading many per `read`, not from more threads. The cost is a
//! thread per connection on the server, bounded by `max_connections`.
//!
//! Measured side by side (`netram bench core`, the same 32 B → 4 KiB exchange): with the PM QoS
//! request held, blocking threads that poll briefly answer in ~10 µs and tokio (multi-thread
//! server, current-thread client) in 15–19 µs, so in the low-latency mode threads win. In the
//! default mode tokio measured *faster* (~44 µs against ~90 µs): its extra runtime threads keep
//! the vCPUs out of deep idle, the same effect as spreading requests over three server threads.
//! That is an idle-state artefact rather than less work, and the low-latency mode removes it
//! more cheaply, but it is real and recorded in `bench-results/core.md`.

pub mod daemon;
pub mod donor;
pub mod gms;
pub mod gossip;
mod http;
pub mod peers;
pub mod shm;

pub use daemon::{Server, ServerConfig, ServerError};
