//! A client that speaks netram's protocol by hand over the real connection: TCP, mutual TLS,
//! HELLO and WELCOME inside TLS, then frames sealed as records (`netram_net::record`). For
//! tests that must say what no pager would (an attacker, a peer of the daemon's parity): one
//! request, one reply, nothing checked but the record's seal.

use netram_net::{handshake, reserve_tags, FrameKeys, HandshakeError, Security};
use netram_proto::{Hello, Request};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

#[derive(Debug)]
pub struct TlsConn {
    pub stream: TcpStream,
    pub keys: FrameKeys,
    next: u64,
}

impl TlsConn {
    /// Connects and handshakes as `security` with `hello`.
    pub fn open(
        addr: SocketAddr,
        security: &Security,
        hello: &Hello,
    ) -> Result<Self, HandshakeError> {
        let c = handshake(addr, hello, Duration::from_secs(10), security)?;
        Ok(Self {
            stream: c.stream,
            keys: c.keys.expect("a TLS connection has frame keys"),
            next: 1,
        })
    }

    /// `req` encoded and sealed as the next record, not sent.
    pub fn seal(&mut self, req: &Request<'_>) -> Vec<u8> {
        let mut f = Vec::new();
        req.encode(self.next, &mut f);
        self.next += 1;
        reserve_tags(&mut f, 0);
        self.keys.send.seal_all(&mut f);
        f
    }

    /// Sends `req` and returns the reply's plain frame (panics if its record does not open).
    pub fn call(&mut self, req: &Request<'_>) -> Vec<u8> {
        let f = self.seal(req);
        self.stream.write_all(&f).expect("send");
        let mut len = [0u8; 4];
        self.stream.read_exact(&mut len).expect("a reply");
        let mut rec = len.to_vec();
        rec.resize(4 + u32::from_le_bytes(len) as usize, 0);
        self.stream
            .read_exact(&mut rec[4..])
            .expect("a whole reply");
        let (n, tail) = self
            .keys
            .recv
            .open(&mut rec)
            .expect("the server's records open");
        assert_eq!(
            tail, 0,
            "no clear tail to a client that did not ask for one"
        );
        rec.truncate(n);
        rec
    }

    /// Whether the server closed the connection (EOF or an error) within `wait`.
    pub fn closed_within(&mut self, wait: Duration) -> bool {
        self.stream.set_read_timeout(Some(wait)).expect("socket");
        let mut b = [0u8; 64];
        matches!(self.stream.read(&mut b), Ok(0) | Err(_))
    }
}
