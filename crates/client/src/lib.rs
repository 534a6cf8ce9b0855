//! The client side of netram's runtime: the thin layer that moves a pager's bytes and time in and
//! out of the I/O-free `netram-pager`. Every front end (`netram nbd`, the C ABI, `netram run`'s
//! preload library) opens its pager here; none of them links the page store.
//!
//! * [`tcp`]: the TCP [`netram_pager::Transport`], with soft-state refresh (Anemone §2.5);
//! * [`discover`]: the servers of the cluster, from this machine's daemon when none are given;
//! * [`disk`]: the local spill file behind [`netram_pager::Disk`] (Markatos, paper 003);
//! * [`open`]: a client pager from servers, backing, size and redundancy, for every front end;
//! * [`env`](mod@env): the `NETRAM_*` environment as one typed configuration (`netram run` writes it,
//!   the preload library and the C ABI read it);
//! * [`maintain`]: the background thread that probes servers, reconnects them and runs
//!   recovery at a bounded rate (Nswap §IV-B3);
//! * [`pressure`]: locking memory and PR_SET_IO_FLUSHER for a process that serves swap;
//! * [`shared`]: a pager shared by threads (the NBD device's connections, a program's), none
//!   holding it across a round trip.
//!
//! Why the pager's own thread does the socket I/O (no async runtime, no hand-off): see
//! `netram-server`'s crate documentation and `netram_net::latency`.

pub mod discover;
pub mod disk;
pub mod env;
pub mod maintain;
pub mod open;
pub mod pressure;
pub mod shared;
pub mod tcp;

pub use netram_net::latency;
pub use netram_net::{Credentials, Security};
pub use open::{open_pager, security, ClientPager, OpenError, OpenOptions, SecurityError};
pub use shared::SharedPager;
pub use tcp::{query_stats, ClientConfig, TcpTransport};
