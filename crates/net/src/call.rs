//! One blocking request and its reply on a kept connection to a named node: what a daemon
//! uses to reach another (parity deltas, handovers: `netram-server`'s `peers.rs`) and what
//! `netram cache` uses to reach the daemons holding its pages. Not the pager's path (that is
//! `netram-client`'s pipelined transport).
//!
//! The connection is opened on first use (the handshake, then a check that the server is the
//! node named: over TLS its certificate's), kept, and opened again when the other side closed
//! it while idle (its idle timeout: nothing was sent on it, so another is as good). After a
//! failure, calls fail at once for [`UNREACHABLE_FOR`], so that a dead host costs one
//! connect timeout, not one per call.

use crate::{handshake, reserve_tags, FrameBuffer, HandshakeError, RecordKey, Security};
use netram_proto::{DecodeError, Hello};
use std::io::{self, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// After a failure, calls to that node fail at once for this long.
pub const UNREACHABLE_FOR: Duration = Duration::from_millis(500);

/// Why a call failed. Each leaves the connection closed.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("failed moments ago")]
    FailedRecently,
    #[error(transparent)]
    Handshake(#[from] HandshakeError),
    #[error("the server there is node {got}, not node {named}")]
    WrongNode { named: u64, got: u64 },
    #[error("{0}: {1}")]
    Io(&'static str, #[source] io::Error),
    #[error("bad frame: {0}")]
    Decode(#[from] DecodeError),
    #[error("no reply in time")]
    Timeout,
    #[error("connection closed")]
    Closed,
}

/// Timeouts of a [`Call`].
#[derive(Debug, Clone, Copy)]
pub struct Patience {
    pub connect: Duration,
    pub reply: Duration,
}

/// A kept connection to one node, and its state between calls.
#[derive(Debug, Default)]
pub struct Call {
    conn: Option<(TcpStream, FrameBuffer, Option<RecordKey>)>,
    failed_at: Option<Instant>,
    next_id: u64,
}

/// Whether a connection with no call outstanding has anything to read: the other side closed
/// it (or broke the protocol by speaking unasked); either way it cannot carry a call.
fn closed_by_peer(s: &TcpStream) -> bool {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let mut fds = [PollFd::new(s, PollFlags::IN)];
    let zero = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    matches!(poll(&mut fds, Some(&zero)), Ok(n) if n > 0)
}

impl Call {
    /// Whether the last call failed (and the node is not asked again for a while).
    pub fn failed_recently(&self) -> bool {
        self.failed_at
            .is_some_and(|t| t.elapsed() < UNREACHABLE_FOR)
    }

    /// Whether the last call failed and no connection is open: a node that can be forgotten.
    pub fn has_failed(&self) -> bool {
        self.conn.is_none() && self.failed_at.is_some()
    }

    /// Has the connection opened afresh at the next call (the node expired this session).
    pub fn reset(&mut self) {
        self.conn = None;
    }

    /// Remembers a failure the caller saw in a reply: no call for [`UNREACHABLE_FOR`].
    pub fn fail(&mut self) {
        self.conn = None;
        self.failed_at = Some(Instant::now());
    }

    /// Sends the request `encode` writes (given the request id) to `node` at `addr`, opening
    /// the connection with `hello` if need be, and returns the first whole frame that comes
    /// back (the caller decodes it and checks its id against the one returned). A failure
    /// closes the connection; [`Call::fail`] is the caller's, once it gives up.
    pub fn call(
        &mut self,
        node: u64,
        addr: SocketAddr,
        hello: impl FnOnce() -> Hello,
        security: &Security,
        patience: Patience,
        encode: impl FnOnce(u64, &mut Vec<u8>),
    ) -> Result<(u64, Vec<u8>), CallError> {
        let exchange = || {
            self.open(node, addr, hello, security, patience)?;
            self.next_id += 1;
            let id = self.next_id;
            let (s, rbuf, seal) = self.conn.as_mut().expect("opened above");
            let mut wbuf = Vec::new();
            encode(id, &mut wbuf);
            if let Some(k) = seal {
                reserve_tags(&mut wbuf, 0);
                k.seal_all(&mut wbuf);
            }
            s.write_all(&wbuf).map_err(|e| CallError::Io("send", e))?;
            let deadline = Instant::now() + patience.reply;
            loop {
                if let Some(f) = rbuf.next_frame()? {
                    return Ok((id, f.to_vec()));
                }
                if Instant::now() > deadline {
                    return Err(CallError::Timeout);
                }
                match rbuf.fill(s, Duration::ZERO) {
                    Ok(0) => return Err(CallError::Closed),
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(CallError::Io("receive", e)),
                }
            }
        };
        let r = exchange();
        if r.is_err() {
            // Whatever was half sent or half read, the next call starts on a new connection;
            // whether to stop calling for a while is the caller's (it may try once more).
            self.conn = None;
        }
        r
    }

    /// Opens the connection to `node` at `addr` unless one is open and not closed by the
    /// other side.
    fn open(
        &mut self,
        node: u64,
        addr: SocketAddr,
        hello: impl FnOnce() -> Hello,
        security: &Security,
        patience: Patience,
    ) -> Result<(), CallError> {
        if self
            .conn
            .as_ref()
            .is_some_and(|(s, _, _)| closed_by_peer(s))
        {
            tracing::debug!(node, "connection closed while idle: opening another");
            self.conn = None;
        }
        if self.conn.is_some() {
            return Ok(());
        }
        if self.failed_recently() {
            return Err(CallError::FailedRecently);
        }
        let c = handshake(addr, &hello(), patience.connect, security)?;
        // Over TLS the WELCOME's node id is the certificate's (checked in the handshake).
        if c.welcome.server_node != node {
            return Err(CallError::WrongNode {
                named: node,
                got: c.welcome.server_node,
            });
        }
        c.stream
            .set_read_timeout(Some(patience.reply))
            .map_err(|e| CallError::Io("socket", e))?;
        c.stream
            .set_write_timeout(Some(patience.reply))
            .map_err(|e| CallError::Io("socket", e))?;
        let (send, recv) = match c.keys {
            Some(k) => (Some(k.send), Some(k.recv)),
            None => (None, None),
        };
        self.conn = Some((c.stream, FrameBuffer::sealed(recv), send));
        Ok(())
    }

    /// Whether a connection is open (as far as this side knows: the other may have gone).
    pub fn is_open(&self) -> bool {
        self.conn.is_some()
    }

    /// Sends as much of `frames` as the open connection takes without waiting, sealed as
    /// [`Call::post`] seals: returns how many of the (sealed) bytes in `frames` went out. The
    /// rest must go next, with [`Call::write_rest`], before anything else: a sealed record
    /// cannot be cut short. For a caller that must never block on a slow peer (a daemon's
    /// shared-memory agent, which also reads that peer's messages: two agents blocked writing
    /// to each other would wait for ever).
    pub fn try_post_open(&mut self, frames: &mut Vec<u8>) -> Result<usize, CallError> {
        if self
            .conn
            .as_ref()
            .is_some_and(|(s, _, _)| closed_by_peer(s))
        {
            self.conn = None;
        }
        let Some((s, _, seal)) = self.conn.as_mut() else {
            return Err(CallError::Closed);
        };
        if let Some(k) = seal {
            reserve_tags(frames, 0);
            k.seal_all(frames);
        }
        let mut sent = 0;
        while sent < frames.len() {
            match rustix::net::send(
                &*s,
                &frames[sent..],
                rustix::net::SendFlags::DONTWAIT | rustix::net::SendFlags::NOSIGNAL,
            ) {
                Ok(n) => sent += n,
                Err(rustix::io::Errno::AGAIN) => break,
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => {
                    self.conn = None;
                    return Err(CallError::Io("send", e.into()));
                }
            }
        }
        Ok(sent)
    }

    /// Writes the bytes [`Call::try_post_open`] could not send, waiting as long as the
    /// connection's write timeout allows.
    pub fn write_rest(&mut self, rest: &[u8]) -> Result<(), CallError> {
        let Some((s, _, _)) = self.conn.as_mut() else {
            return Err(CallError::Closed);
        };
        let r = s.write_all(rest).map_err(|e| CallError::Io("send", e));
        if r.is_err() {
            self.conn = None;
        }
        r
    }

    /// Sends `frames` (whole frames, each with request id 0: messages that are not
    /// answered) to `node` at `addr`, opening the connection if need be. Nothing is read
    /// back; a failure closes the connection, and the caller decides what the frames lost
    /// mean.
    pub fn post(
        &mut self,
        node: u64,
        addr: SocketAddr,
        hello: impl FnOnce() -> Hello,
        security: &Security,
        patience: Patience,
        frames: &mut Vec<u8>,
    ) -> Result<(), CallError> {
        let r = self
            .open(node, addr, hello, security, patience)
            .and_then(|()| {
                let (s, _, seal) = self.conn.as_mut().expect("opened above");
                if let Some(k) = seal {
                    reserve_tags(frames, 0);
                    k.seal_all(frames);
                }
                s.write_all(frames).map_err(|e| CallError::Io("send", e))
            });
        if r.is_err() {
            self.conn = None;
        }
        r
    }
}
