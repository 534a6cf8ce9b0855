//! NBD's TLS (the protocol's NBD_OPT_STARTTLS, as nbdkit, qemu-nbd and nbd-client speak it):
//! after the client asks for it in the option haggling, the rest of the connection runs inside
//! TLS 1.3, and the client must present a certificate of the cluster (the one the daemons use,
//! `netram keygen`). GMS §6's rule for the front end: whoever reaches the device over the
//! network is a member of the cluster, and nobody on the path sees or changes its blocks.
//!
//! The handshake is served by the connection's own thread, which reads an option and then
//! writes its reply, never both at once, so one rustls stream behind a mutex serves both of
//! the connection's handles; shutting the connection down goes to the TCP socket beside it, so
//! that the accept loop can end a connection blocked in a read without taking the lock. The
//! transmission phase takes the rustls session out ([`TlsSocket`]'s `into_stream`) and runs it
//! without blocking in the transmission loop (`crate::transmit::Tls`).

use crate::server::Socket;
use rustls::{ServerConfig, ServerConnection, StreamOwned};
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

/// The TLS configuration `netram nbd` serves with, replaceable while it runs (a new revocation
/// list applies to the next connections).
pub type TlsConfig = Arc<RwLock<Arc<ServerConfig>>>;

/// A TCP connection after NBD_OPT_STARTTLS.
pub struct TlsSocket {
    tls: Arc<Mutex<StreamOwned<ServerConnection, TcpStream>>>,
    tcp: TcpStream,
    /// The node the client's certificate names.
    node: Option<u64>,
}

impl TlsSocket {
    /// Runs the TLS handshake on `tcp` (its read timeout bounds each wait; the accept loop's
    /// handshake deadline shuts the socket down under it).
    pub fn accept(
        tcp: TcpStream,
        config: Arc<ServerConfig>,
        timeout: Duration,
    ) -> io::Result<Self> {
        let mut conn = ServerConnection::new(config).map_err(io::Error::other)?;
        let mut sock = tcp.try_clone()?;
        sock.set_read_timeout(Some(timeout))?;
        while conn.is_handshaking() {
            match conn.complete_io(&mut sock) {
                Ok((0, 0)) if conn.wants_read() => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // Tell the client why (a refused certificate is an alert), then close.
                    let _ = conn.write_tls(&mut sock);
                    return Err(e);
                }
            }
        }
        // The transmission phase blocks in reads for as long as the client is idle.
        sock.set_read_timeout(None)?;
        let node = conn
            .peer_certificates()
            .and_then(|c| c.first())
            .and_then(|der| netram_net::tls::identity_of(der).ok())
            .map(|id| id.node);
        Ok(Self {
            tls: Arc::new(Mutex::new(StreamOwned::new(conn, sock))),
            tcp,
            node,
        })
    }

    fn stream(&self) -> std::sync::MutexGuard<'_, StreamOwned<ServerConnection, TcpStream>> {
        self.tls.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl std::fmt::Debug for TlsSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsSocket")
            .field("tcp", &self.tcp)
            .finish_non_exhaustive()
    }
}

impl Read for TlsSocket {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.stream().read(buf)
    }
}

impl Write for TlsSocket {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream().write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.stream().flush()
    }
}

impl Socket for TlsSocket {
    fn try_clone(&self) -> io::Result<Self> {
        Ok(Self {
            tls: self.tls.clone(),
            tcp: self.tcp.try_clone()?,
            node: self.node,
        })
    }
    fn shut(&self) {
        let _ = self.tcp.shutdown(std::net::Shutdown::Both);
    }
    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.tcp.set_write_timeout(t)
    }
    fn peer(&self) -> String {
        self.tcp.peer()
    }
    fn source(&self) -> netram_policy::admission::Source {
        self.tcp.source()
    }
    fn hung_up(&self) -> bool {
        self.tcp.hung_up()
    }
    fn node(&self) -> Option<u64> {
        self.node
    }
    fn into_stream(self) -> io::Result<Box<dyn crate::transmit::Stream>> {
        let Self { tls, tcp, .. } = self;
        drop(tcp);
        let stream = Arc::try_unwrap(tls)
            .map_err(|_| io::Error::other("the TLS session is still shared"))?
            .into_inner()
            .unwrap_or_else(|p| p.into_inner());
        let (conn, tcp) = stream.into_parts();
        tcp.set_nonblocking(true)?;
        Ok(Box::new(crate::transmit::Tls { conn, tcp }))
    }
}
