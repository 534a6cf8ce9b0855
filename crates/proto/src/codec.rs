//! Little-endian primitives: a bounds-checked reader over received bytes and a frame builder
//! that appends to a caller's buffer and patches the length prefix when the frame is finished.

use crate::{FRAME_HEADER_LEN, FRAME_VERSION, MAX_FRAME_LEN};

/// Why bytes from a peer were not a valid message. Each variant is one reason the daemon counts
/// and logs before it closes the connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The message ended before a field it announced.
    #[error("truncated: needed {needed} more bytes")]
    Truncated { needed: usize },
    /// The handshake did not start with netram's magic: not a netram peer.
    #[error("bad magic: not a netram peer")]
    BadMagic,
    /// The handshake or frame names a version this build does not speak.
    #[error("unsupported version {got}")]
    UnsupportedVersion { got: u16 },
    /// The length prefix announces more than [`MAX_FRAME_LEN`] or less than a header.
    #[error("bad frame length {len} (allowed {min}..={max})")]
    BadLength { len: usize, min: usize, max: usize },
    /// The frame kind is not one this side accepts.
    #[error("unknown or unexpected frame kind {0:#04x}")]
    UnknownKind(u8),
    /// A batch announces more entries than [`crate::MAX_BATCH`], or more than its bytes can hold.
    #[error("batch of {count} entries is too large")]
    BatchTooLarge { count: usize },
    /// Reserved bits or bytes were not zero, or flags had unknown bits set.
    #[error("reserved field {field} is {value:#x}, expected 0")]
    Reserved { field: &'static str, value: u64 },
    /// A page envelope's data length does not match its flags.
    #[error("page data length {len} does not match flags {flags:#06x}")]
    BadPageLength { len: usize, flags: u16 },
    /// An enumerated field had a value outside its range.
    #[error("field {field} has unknown value {value}")]
    BadValue { field: &'static str, value: u64 },
    /// A string field was not UTF-8.
    #[error("field {0} is not UTF-8")]
    BadUtf8(&'static str),
    /// The frame's body was longer than its message.
    #[error("{0} trailing bytes after the message")]
    TrailingBytes(usize),
    /// A sealed record did not authenticate (forged, damaged, replayed or out of order).
    #[error("record does not authenticate")]
    Unauthenticated,
}

/// Reads little-endian fields from a byte slice, failing with [`DecodeError::Truncated`] rather
/// than panicking when the slice is short.
#[derive(Debug)]
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Self { buf }
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len()
    }

    pub(crate) fn bytes(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.buf.len() < n {
            return Err(DecodeError::Truncated {
                needed: n - self.buf.len(),
            });
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    pub(crate) fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let b = self.bytes(N)?;
        let mut out = [0u8; N];
        out.copy_from_slice(b);
        Ok(out)
    }

    pub(crate) fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.array::<1>()?[0])
    }
    pub(crate) fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    pub(crate) fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    pub(crate) fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A reserved field: must be zero, so that a later version can give it a meaning.
    pub(crate) fn reserved_u16(&mut self, field: &'static str) -> Result<(), DecodeError> {
        match self.u16()? {
            0 => Ok(()),
            v => Err(DecodeError::Reserved {
                field,
                value: v.into(),
            }),
        }
    }
    pub(crate) fn reserved_u32(&mut self, field: &'static str) -> Result<(), DecodeError> {
        match self.u32()? {
            0 => Ok(()),
            v => Err(DecodeError::Reserved {
                field,
                value: v.into(),
            }),
        }
    }

    /// A batch count, checked against the batch limit and against the bytes left, so that a
    /// lying count cannot make the decoder allocate more than the frame itself.
    pub(crate) fn count(&mut self, min_entry_len: usize) -> Result<usize, DecodeError> {
        let count = self.u32()? as usize;
        if count > crate::MAX_BATCH || count * min_entry_len > self.remaining() {
            return Err(DecodeError::BatchTooLarge { count });
        }
        Ok(count)
    }

    pub(crate) fn finish(self) -> Result<(), DecodeError> {
        match self.buf.len() {
            0 => Ok(()),
            n => Err(DecodeError::TrailingBytes(n)),
        }
    }
}

/// Appends one frame to a buffer: the header is written by [`FrameBuilder::begin`], fields are
/// appended, and [`FrameBuilder::finish`] patches the length prefix. Several frames can be built
/// back to back into one buffer and sent with one `write`, which is how the client pipelines.
#[derive(Debug)]
pub struct FrameBuilder<'v> {
    out: &'v mut Vec<u8>,
    start: usize,
}

impl<'v> FrameBuilder<'v> {
    pub fn begin(out: &'v mut Vec<u8>, kind: u8, req_id: u64) -> Self {
        let start = out.len();
        out.extend_from_slice(&0u32.to_le_bytes()); // patched by finish()
        out.push(FRAME_VERSION);
        out.push(kind);
        out.extend_from_slice(&0u16.to_le_bytes()); // flags, reserved
        out.extend_from_slice(&req_id.to_le_bytes());
        Self { out, start }
    }

    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.out.push(v);
        self
    }
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.out.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.out.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.out.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.out.extend_from_slice(v);
        self
    }

    /// Writes the length prefix. The builder's callers only append what the decoder accepts, so
    /// a frame over the limit is a programming error, not a peer's fault.
    pub fn finish(self) {
        let len = self.out.len() - self.start;
        assert!(
            (FRAME_HEADER_LEN..=MAX_FRAME_LEN).contains(&len),
            "built a frame of {len} bytes"
        );
        let prefix = ((len - 4) as u32).to_le_bytes();
        self.out[self.start..self.start + 4].copy_from_slice(&prefix);
    }
}
