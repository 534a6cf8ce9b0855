//! Frames sealed on the wire after a TLS handshake: AES-128-GCM records keyed from the TLS
//! session's exporter (RFC 8446 §7.5), one per frame.
//!
//! The handshake is TLS 1.3 with a certificate on both ends (`tls.rs`); after it, netram
//! leaves rustls behind and seals its own frames. Why not keep TLS's record layer: a GET's
//! reply is one 4 KiB frame, and rustls takes 1.27 µs to write and read one such record on the
//! development VM (its copies between its buffers and ours, and the cipher), about a sixth of a
//! low-latency GET. Sealing in place in the buffers the frames are already in costs the cipher
//! alone (0.4 µs), and the frames keep the one `write` and one `read` per batch that the
//! design counts. This is the same split kTLS makes (handshake in user space, records
//! elsewhere), with netram's frames as the records.
//!
//! ```text
//! record = len:u32 (frame body + 16, in clear) | frame body (sealed in place) | tag:16
//! ```
//!
//! The frame's own length prefix becomes the record's (plus the tag), in clear and
//! authenticated as associated data; the nonce is a counter per direction that both ends keep
//! (TCP delivers records in order, so it never travels). A record that does not open closes
//! the connection: one forged or damaged byte anywhere is refused, counted, and never read.
//!
//! Writers reserve [`TAG_LEN`] bytes after every frame they encode ([`reserve_tags`]), so
//! sealing a whole buffer of frames moves no byte.

use netram_proto::{frame_len, DecodeError, FRAME_HEADER_LEN, MAX_FRAME_LEN};
use ring::aead::{Aad, LessSafeKey, Nonce, Tag, UnboundKey, AES_128_GCM};
use std::fmt;

/// Bytes of a record's tag, after its frame.
pub const TAG_LEN: usize = 16;
/// Bytes of key material for one direction.
pub const KEY_LEN: usize = 16;
/// The largest record: the largest frame and its tag.
pub const MAX_RECORD_LEN: usize = MAX_FRAME_LEN + TAG_LEN;

/// The key and nonce counter of one direction of one connection.
pub struct RecordKey {
    key: LessSafeKey,
    counter: u64,
}

impl fmt::Debug for RecordKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecordKey")
            .field("counter", &self.counter)
            .finish_non_exhaustive()
    }
}

impl RecordKey {
    pub fn new(key: &[u8; KEY_LEN]) -> Self {
        Self {
            key: LessSafeKey::new(UnboundKey::new(&AES_128_GCM, key).expect("a 16-byte key")),
            counter: 0,
        }
    }

    fn next_nonce(&mut self) -> Nonce {
        let mut n = [0u8; 12];
        n[..8].copy_from_slice(&self.counter.to_le_bytes());
        // 2^64 records would take centuries at any rate this code reaches; never wraps.
        self.counter += 1;
        Nonce::assume_unique_for_key(n)
    }

    /// Seals every frame of `buf`, each followed by [`TAG_LEN`] bytes of room (as
    /// [`reserve_tags`] leaves them), in place, in order.
    pub fn seal_all(&mut self, buf: &mut [u8]) {
        let mut at = 0;
        while at < buf.len() {
            let body = u32::from_le_bytes(buf[at..at + 4].try_into().expect("4 bytes")) as usize;
            let end = at + 4 + body;
            let len = ((body + TAG_LEN) as u32).to_le_bytes();
            buf[at..at + 4].copy_from_slice(&len);
            let nonce = self.next_nonce();
            let tag = self
                .key
                .seal_in_place_separate_tag(nonce, Aad::from(len), &mut buf[at + 4..end])
                .expect("a frame is far below AES-GCM's message limit");
            buf[end..end + TAG_LEN].copy_from_slice(tag.as_ref());
            at = end + TAG_LEN;
        }
        debug_assert_eq!(at, buf.len(), "frames and their tag room fill the buffer");
    }

    /// Opens the whole record `rec` (length prefix included) in place. On success its first
    /// `4 + body` bytes are the plain frame (its length prefix rewritten), and its length is
    /// returned; a record that does not authenticate is an error and must close the
    /// connection (the counter has moved on: nothing after it can open either).
    pub fn open(&mut self, rec: &mut [u8]) -> Result<usize, DecodeError> {
        let len: [u8; 4] = rec[..4].try_into().expect("a whole record");
        let sealed = rec.len() - 4;
        if sealed < TAG_LEN + FRAME_HEADER_LEN - 4 {
            return Err(DecodeError::BadLength {
                len: sealed,
                min: TAG_LEN + FRAME_HEADER_LEN - 4,
                max: MAX_RECORD_LEN - 4,
            });
        }
        let body = sealed - TAG_LEN;
        let tag: [u8; TAG_LEN] = rec[4 + body..].try_into().expect("tag");
        let nonce = self.next_nonce();
        self.key
            .open_in_place_separate_tag(
                nonce,
                Aad::from(len),
                Tag::from(tag),
                &mut rec[4..4 + body],
                0..,
            )
            .map_err(|_| DecodeError::Unauthenticated)?;
        rec[..4].copy_from_slice(&(body as u32).to_le_bytes());
        Ok(4 + body)
    }
}

/// Leaves [`TAG_LEN`] bytes of room after every frame of `buf` from `from` on (frames a writer
/// has just encoded there), for [`RecordKey::seal_all`]. One frame (the usual case) costs a
/// push; several are spread out once.
pub fn reserve_tags(buf: &mut Vec<u8>, from: usize) {
    let mut starts = Vec::new();
    let mut at = from;
    while at < buf.len() {
        starts.push(at);
        let body = u32::from_le_bytes(buf[at..at + 4].try_into().expect("a frame")) as usize;
        at += 4 + body;
    }
    debug_assert_eq!(at, buf.len(), "whole frames from {from}");
    let n = starts.len();
    if n == 0 {
        return;
    }
    let old = buf.len();
    buf.resize(old + n * TAG_LEN, 0);
    // From the last frame back, each moves by the room of the frames before it.
    let mut end = old;
    for (i, &s) in starts.iter().enumerate().rev() {
        let shift = i * TAG_LEN;
        if shift > 0 {
            buf.copy_within(s..end, s + shift);
        }
        end = s;
    }
}

/// How many bytes the record at the start of `buf` occupies, once its length prefix has
/// arrived: [`frame_len`] with room for the tag.
pub fn record_len(buf: &[u8]) -> Result<Option<usize>, DecodeError> {
    let Some(prefix) = buf.get(..4) else {
        return Ok(None);
    };
    let len = u32::from_le_bytes(prefix.try_into().expect("4 bytes")) as usize + 4;
    if !(FRAME_HEADER_LEN + TAG_LEN..=MAX_RECORD_LEN).contains(&len) {
        return Err(DecodeError::BadLength {
            len,
            min: FRAME_HEADER_LEN + TAG_LEN,
            max: MAX_RECORD_LEN,
        });
    }
    Ok(Some(len))
}

/// [`record_len`] when records are sealed, [`frame_len`] otherwise.
pub fn unit_len(buf: &[u8], sealed: bool) -> Result<Option<usize>, DecodeError> {
    if sealed {
        record_len(buf)
    } else {
        frame_len(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use netram_proto::{decode_request, PageKey, Request};

    fn frames() -> Vec<u8> {
        let mut b = Vec::new();
        Request::Get(vec![PageKey::new(1, 2)]).encode(7, &mut b);
        reserve_tags(&mut b, 0);
        let mark = b.len();
        Request::Stats.encode(8, &mut b);
        Request::Refresh.encode(9, &mut b);
        reserve_tags(&mut b, mark);
        b
    }

    fn read_all(key: &mut RecordKey, mut buf: Vec<u8>) -> Result<Vec<u64>, DecodeError> {
        let mut ids = Vec::new();
        let mut at = 0;
        while at < buf.len() {
            let n = record_len(&buf[at..])?.expect("whole");
            if at + n > buf.len() {
                // A length that lies: a reader waits for bytes that never come.
                return Err(DecodeError::Truncated {
                    needed: at + n - buf.len(),
                });
            }
            let f = key.open(&mut buf[at..at + n])?;
            ids.push(decode_request(&buf[at..at + f])?.0);
            at += n;
        }
        Ok(ids)
    }

    #[test]
    fn records_open_in_order_and_refuse_any_change() {
        let k = [3u8; KEY_LEN];
        let mut b = frames();
        RecordKey::new(&k).seal_all(&mut b);
        assert_eq!(
            read_all(&mut RecordKey::new(&k), b.clone()),
            Ok(vec![7, 8, 9])
        );
        // Any one byte changed anywhere, the length prefix included, is refused.
        for i in 0..b.len() {
            let mut bad = b.clone();
            bad[i] ^= 0x10;
            assert!(read_all(&mut RecordKey::new(&k), bad).is_err(), "byte {i}");
        }
        // Another key, a replayed or reordered record: refused.
        assert!(read_all(&mut RecordKey::new(&[4u8; KEY_LEN]), b.clone()).is_err());
        let first = record_len(&b).unwrap().unwrap();
        let mut replay = b[..first].to_vec();
        replay.extend_from_slice(&b[..first]);
        assert_eq!(
            read_all(&mut RecordKey::new(&k), replay),
            Err(DecodeError::Unauthenticated)
        );
    }
}
