//! Opening a connection to a page server: TCP connect, HELLO, WELCOME (the wire format is in
//! `netram_proto::handshake`). Clients (`netram-client`) and servers forwarding parity deltas to
//! each other (`netram-server`'s peers) open their connections the same way.

use netram_proto::{DecodeError, Hello, Welcome, WelcomeStatus, WELCOME_LEN};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// Why a connection could not be opened. Each is a reason to treat the server as dead.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("connect: {0}")]
    Connect(#[source] io::Error),
    #[error("handshake: {0}")]
    Io(#[from] io::Error),
    #[error("handshake: {0}")]
    Decode(#[from] DecodeError),
    #[error("server speaks protocol version {server}, this client {client}")]
    VersionUnsupported { server: u16, client: u16 },
    #[error("server is at its connection limit")]
    Busy,
    #[error("server's session table is full")]
    TooManySessions,
    #[error("server has seen a newer incarnation of this node")]
    StaleIncarnation,
}

/// Connects to `addr` within `timeout`, sends `hello` and reads the server's WELCOME. The
/// stream comes back with Nagle off and `timeout` as its read timeout.
pub fn handshake(
    addr: SocketAddr,
    hello: &Hello,
    timeout: Duration,
) -> Result<(TcpStream, Welcome), HandshakeError> {
    let mut s = TcpStream::connect_timeout(&addr, timeout).map_err(HandshakeError::Connect)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(timeout))?;
    s.write_all(&hello.encode())?;
    let mut buf = [0u8; WELCOME_LEN];
    s.read_exact(&mut buf)?;
    let w = Welcome::decode(&buf)?;
    match w.status {
        WelcomeStatus::Ok => Ok((s, w)),
        WelcomeStatus::VersionUnsupported => Err(HandshakeError::VersionUnsupported {
            server: w.version,
            client: netram_proto::PROTOCOL_VERSION,
        }),
        WelcomeStatus::Busy => Err(HandshakeError::Busy),
        WelcomeStatus::TooManySessions => Err(HandshakeError::TooManySessions),
        WelcomeStatus::StaleIncarnation => Err(HandshakeError::StaleIncarnation),
    }
}
