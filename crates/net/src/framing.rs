//! A receive buffer that yields whole frames, shared by the server and the client. Over TLS it
//! opens each sealed record in place as it yields it (`record.rs`); a record that does not
//! authenticate is an error like a malformed frame, and closes the connection.
//!
//! It grows only to the largest frame actually seen (bounded by `MAX_FRAME_LEN`, which
//! `frame_len` enforces before any body is awaited), so an idle connection costs 64 KiB.

use crate::record::{unit_len, RecordKey, MAX_RECORD_LEN};
use netram_proto::DecodeError;
use std::io::{self, Read};
use std::net::TcpStream;
use std::time::{Duration, Instant};

const INITIAL: usize = 64 * 1024;

#[derive(Debug)]
pub struct FrameBuffer {
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// Adaptive polling: poll before the next read only if the last wait was short enough for
    /// polling to catch it. A connection whose data comes rarely (one of three servers a client
    /// spreads its pages over) stops polling and leaves the CPU to the thread that will answer.
    poll_next: bool,
    /// The key that opens sealed records; `None` over clear TCP.
    open: Option<RecordKey>,
    /// Whether a record may leave its frame's last bytes in clear (`record.rs`: a GET reply's
    /// page data, to a client that seals its pages), and how many the last frame left.
    allow_clear_tail: bool,
    last_clear_tail: usize,
    /// The last `fill_now` read less than it had room for: the socket had no more then.
    drained: bool,
}

impl Default for FrameBuffer {
    fn default() -> Self {
        Self::new()
    }
}

impl FrameBuffer {
    pub fn new() -> Self {
        Self {
            buf: vec![0u8; INITIAL],
            start: 0,
            end: 0,
            poll_next: true,
            open: None,
            allow_clear_tail: false,
            last_clear_tail: 0,
            drained: false,
        }
    }

    /// Lets records leave their frame's last bytes in clear: only for a client whose pager
    /// seals every page, which checks them ([`FrameBuffer::last_clear_tail`]).
    pub fn allow_clear_tail(mut self) -> Self {
        self.allow_clear_tail = true;
        self
    }

    /// How many bytes at the end of the frame [`FrameBuffer::next_frame`] last returned came in
    /// clear (0 over clear TCP, where nothing is sealed, and for every other frame).
    pub fn last_clear_tail(&self) -> usize {
        self.last_clear_tail
    }

    /// A buffer whose records are sealed under `key` (`None`: clear frames).
    pub fn sealed(key: Option<RecordKey>) -> Self {
        Self {
            open: key,
            ..Self::new()
        }
    }

    /// Bytes received but not yet consumed as frames.
    pub fn pending(&self) -> usize {
        self.end - self.start
    }

    /// Whether a whole frame has arrived; an error if the length prefix is invalid.
    pub fn has_frame(&self) -> Result<bool, DecodeError> {
        let avail = &self.buf[self.start..self.end];
        Ok(matches!(unit_len(avail, self.open.is_some())?, Some(len) if len <= avail.len()))
    }

    /// The next whole frame, if one has arrived; an error if the length prefix is invalid or
    /// (sealed) the record does not authenticate.
    pub fn next_frame(&mut self) -> Result<Option<&[u8]>, DecodeError> {
        Ok(self.next_frame_tail()?.map(|(f, _)| f))
    }

    /// [`FrameBuffer::next_frame`], with how many bytes at the frame's end came in clear.
    pub fn next_frame_tail(&mut self) -> Result<Option<(&[u8], usize)>, DecodeError> {
        let avail = &self.buf[self.start..self.end];
        match unit_len(avail, self.open.is_some())? {
            Some(len) if len <= avail.len() => {
                let at = self.start;
                self.start += len;
                let (frame, tail) = match &mut self.open {
                    Some(key) => key.open(&mut self.buf[at..at + len])?,
                    None => (len, 0),
                };
                if tail > 0 && !self.allow_clear_tail {
                    return Err(DecodeError::Unauthenticated);
                }
                self.last_clear_tail = tail;
                Ok(Some((&self.buf[at..at + frame], tail)))
            }
            _ => Ok(None),
        }
    }

    /// Reads more bytes from the stream: first polling without blocking for up to `spin`
    /// (the low-latency mode), then blocking, subject to the stream's read timeout.
    /// Returns 0 at end of stream.
    pub fn fill(&mut self, stream: &mut TcpStream, spin: Duration) -> io::Result<usize> {
        self.make_room();
        let started = Instant::now();
        // The token is held only while polling, never across the blocking read below: an idle
        // connection blocked in `read` must not keep a busy one from polling.
        let polling = !spin.is_zero() && self.poll_next;
        if let Some(_token) = polling.then(crate::latency::PollToken::try_take).flatten() {
            let until = started + spin;
            loop {
                match rustix::net::recv(
                    &*stream,
                    &mut self.buf[self.end..],
                    rustix::net::RecvFlags::DONTWAIT,
                ) {
                    Ok((n, _)) => {
                        self.end += n;
                        return Ok(n);
                    }
                    Err(rustix::io::Errno::AGAIN) if Instant::now() < until => {
                        std::hint::spin_loop()
                    }
                    Err(rustix::io::Errno::AGAIN) => break,
                    Err(rustix::io::Errno::INTR) => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
        let n = stream.read(&mut self.buf[self.end..])?;
        self.end += n;
        if !spin.is_zero() {
            self.poll_next = started.elapsed() <= spin;
        }
        Ok(n)
    }

    /// Reads what has arrived without waiting: `None` when nothing has (the read would block).
    pub fn fill_now(&mut self, stream: &TcpStream) -> io::Result<Option<usize>> {
        self.make_room();
        loop {
            match rustix::net::recv(
                stream,
                &mut self.buf[self.end..],
                rustix::net::RecvFlags::DONTWAIT,
            ) {
                Ok((n, _)) => {
                    self.drained = self.end + n < self.buf.len();
                    self.end += n;
                    return Ok(Some(n));
                }
                Err(rustix::io::Errno::AGAIN) => {
                    self.drained = true;
                    return Ok(None);
                }
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Whether the last [`fill_now`](Self::fill_now) emptied the socket: it read less than it
    /// had room for. A level-triggered poller need not read again until the descriptor is
    /// ready again, which saves the `recv` that would only say `EAGAIN` (one per wake-up of
    /// the shared-memory agent, whose CPU per message bounds its latency here).
    pub fn drained(&self) -> bool {
        self.drained
    }

    /// Moves unconsumed bytes to the front and makes sure a whole frame of the announced
    /// length (at most `MAX_FRAME_LEN`) fits.
    fn make_room(&mut self) {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.start > 0 && self.buf.len() - self.end < INITIAL / 4 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let want = match unit_len(&self.buf[self.start..self.end], self.open.is_some()) {
            Ok(Some(len)) => len,
            _ => 0,
        };
        let need = (self.start + want)
            .max(self.end + 1)
            .min(self.start + MAX_RECORD_LEN + 4);
        if need > self.buf.len() {
            self.buf.resize(
                need.max(self.buf.len() * 2).min(MAX_RECORD_LEN + INITIAL),
                0,
            );
        }
        if self.end == self.buf.len() {
            // Only when a frame larger than the limit is pending; frame_len rejects it next.
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
    }
}
