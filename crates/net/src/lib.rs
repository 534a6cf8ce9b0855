//! The TCP plumbing that page servers and clients share, and nothing else: a receive buffer
//! that yields whole frames ([`framing`]), the low-latency mode ([`latency`]: PM QoS request and
//! adaptive polling, `../shared/MACHINE-NOTES.md`), and opening a connection ([`handshake`]).
//! The roles themselves live in `netram-server` (the daemon) and `netram-client` (the transport
//! the pager drives), so that a client links no page store and a server no pager.

pub mod framing;
pub mod handshake;
pub mod latency;

pub use framing::FrameBuffer;
pub use handshake::{handshake, HandshakeError};
