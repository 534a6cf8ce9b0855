//! The TCP plumbing that page servers and clients share, and nothing else: a receive buffer
//! that yields whole frames ([`framing`]), the low-latency mode ([`latency`]: PM QoS request and
//! adaptive polling, `../shared/MACHINE-NOTES.md`), opening a connection ([`handshake`](mod@handshake)),
//! one blocking request and its reply on a kept connection to a named node ([`call`]), and
//! who may open one: mutual TLS against the cluster's CA ([`tls`]), the certificates and
//! revocation lists themselves ([`pki`]), and the sealed frames that follow ([`record`]).
//! The roles themselves live in `netram-server` (the daemon) and `netram-client` (the transport
//! the pager drives), so that a client links no page store and a server no pager.

pub mod call;
pub mod framing;
pub mod handshake;
pub mod latency;
pub mod pki;
pub mod record;
pub mod tls;

pub use call::{Call, CallError, Patience};
pub use framing::FrameBuffer;
pub use handshake::{handshake, HandshakeError, Security};
pub use record::{reserve_tags, RecordKey};
pub use tls::{Credentials, FrameKeys, PeerIdentity, TlsError};
