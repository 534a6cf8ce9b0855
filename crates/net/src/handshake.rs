//! Opening a connection to a page server: TCP connect, then (unless the operator chose clear
//! TCP for loopback development) mutual TLS, then HELLO and WELCOME (the wire format is in
//! `netram_proto::handshake`) — inside TLS, so that no session id is ever seen on the wire.
//! Clients (`netram-client`) and servers forwarding parity deltas to each other
//! (`netram-server`'s peers) open their connections the same way.

use crate::tls::{self, Credentials, FrameKeys, PeerIdentity, TlsError};
use netram_proto::{DecodeError, Hello, Welcome, WelcomeStatus, WELCOME_LEN};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How a node talks to the others.
#[derive(Debug, Clone)]
pub enum Security {
    /// Mutual TLS with this node's credentials, frames sealed (`record.rs`): the default.
    Tls(Arc<Credentials>),
    /// Clear TCP, anyone who can connect trusted: loopback development only, and only when
    /// the operator says so (`--insecure`).
    Insecure,
}

impl Security {
    pub fn is_secure(&self) -> bool {
        matches!(self, Security::Tls(_))
    }
}

/// Why a connection could not be opened. Each is a reason to treat the server as dead.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("connect: {0}")]
    Connect(#[source] io::Error),
    #[error("handshake: {0}")]
    Io(#[from] io::Error),
    #[error("handshake: {0}")]
    Decode(#[from] DecodeError),
    #[error("{0}")]
    Tls(#[from] TlsError),
    #[error("server speaks protocol version {server}, this client {client}")]
    VersionUnsupported { server: u16, client: u16 },
    #[error("server is at its connection limit")]
    Busy,
    #[error("server's session table is full")]
    TooManySessions,
    #[error("server has seen a newer incarnation of this node")]
    StaleIncarnation,
    #[error(
        "the server closed the connection at the handshake: it serves only over TLS (give \
         this node's credentials, --tls) or refused this client"
    )]
    ClosedInClear,
    #[error("the server answered in clear, not over TLS, and not \"busy\"")]
    ClearReply,
    #[error("server's certificate is node {cert}, its welcome says node {claimed}")]
    WrongNode { cert: u64, claimed: u64 },
}

/// An open connection, after its handshake.
#[derive(Debug)]
pub struct Connected {
    pub stream: TcpStream,
    pub welcome: Welcome,
    /// The sealed frames' keys; `None` over clear TCP.
    pub keys: Option<FrameKeys>,
    /// The server, as its certificate says; `None` over clear TCP.
    pub peer: Option<PeerIdentity>,
}

/// Connects to `addr` within `timeout`, sends `hello` and reads the server's WELCOME. The
/// stream comes back with Nagle off and `timeout` as its read timeout.
pub fn handshake(
    addr: SocketAddr,
    hello: &Hello,
    timeout: Duration,
    security: &Security,
) -> Result<Connected, HandshakeError> {
    let deadline = Instant::now() + timeout;
    let mut s = TcpStream::connect_timeout(&addr, timeout).map_err(HandshakeError::Connect)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(timeout))?;
    let mut buf = [0u8; WELCOME_LEN];
    let (keys, peer) = match security {
        Security::Insecure => {
            s.write_all(&hello.encode())?;
            s.read_exact(&mut buf).map_err(|e| match e.kind() {
                io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset => {
                    HandshakeError::ClosedInClear
                }
                _ => e.into(),
            })?;
            (None, None)
        }
        Security::Tls(creds) => {
            match tls::connect(
                &mut s,
                &creds.current(),
                &hello.encode(),
                &mut buf,
                deadline,
            )? {
                Some((peer, keys)) => (Some(keys), Some(peer)),
                // Said in clear, unauthenticated: believed only as "busy".
                None => {
                    return Err(match Welcome::decode(&buf) {
                        Ok(w) if w.status == WelcomeStatus::Busy => HandshakeError::Busy,
                        _ => HandshakeError::ClearReply,
                    })
                }
            }
        }
    };
    s.set_read_timeout(Some(timeout))?;
    let w = Welcome::decode(&buf)?;
    match w.status {
        WelcomeStatus::Ok => {}
        WelcomeStatus::VersionUnsupported => {
            return Err(HandshakeError::VersionUnsupported {
                server: w.version,
                client: netram_proto::PROTOCOL_VERSION,
            })
        }
        WelcomeStatus::Busy => return Err(HandshakeError::Busy),
        WelcomeStatus::TooManySessions => return Err(HandshakeError::TooManySessions),
        WelcomeStatus::StaleIncarnation => return Err(HandshakeError::StaleIncarnation),
    }
    if let Some(p) = &peer {
        if p.node != w.server_node {
            return Err(HandshakeError::WrongNode {
                cert: p.node,
                claimed: w.server_node,
            });
        }
    }
    Ok(Connected {
        stream: s,
        welcome: w,
        keys,
        peer,
    })
}
