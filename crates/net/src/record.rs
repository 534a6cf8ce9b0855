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
//! record = len:u32 (frame body + 20, in clear) | frame body: sealed part | clear tail
//!        | tail:u32 (length of the clear tail, in clear) | tag:16
//! ```
//!
//! The frame's own length prefix becomes the record's (plus the trailer), in clear and
//! authenticated as associated data with the tail's length; the nonce is a counter per
//! direction that both ends keep (TCP delivers records in order, so it never travels). A
//! record that does not open closes the connection: one forged or damaged byte anywhere is
//! refused, counted, and never read.
//!
//! **The clear tail** is for one thing only: the pages' data of a GET reply (which follows all
//! of the reply's entries) to a client that seals its pages end to end (it said so in its
//! HELLO). Those pages are ciphertext under the client's own key, authenticated by the client
//! against the tags it kept (the pager's `seal.rs`), so sealing them a second time here would
//! buy nothing but a second pass over 4 KiB per page on each side (~0.8 µs of a ~8 µs GET).
//! Everything before them — the header, the request id, every entry with its envelope — is
//! sealed; a client that does not seal its pages is never sent a tail and refuses one; a
//! client that does accepts a tail only when it is exactly the reply's page data, as the
//! sealed part of the frame describes it (`netram_proto::get_reply_tail`). PUT bodies are always sealed here: a server cannot check
//! a page's own tag, and a body changed on the way and acknowledged would be data lost.
//!
//! Writers reserve [`TRAILER_LEN`] bytes after every frame they encode ([`reserve_tags`]), so
//! sealing a whole buffer of frames moves no byte.

use netram_proto::{frame_len, DecodeError, FRAME_HEADER_LEN, MAX_FRAME_LEN};
use ring::aead::{Aad, LessSafeKey, Nonce, Tag, UnboundKey, AES_128_GCM};
use std::fmt;

/// Bytes of a record's tag, at its end.
pub const TAG_LEN: usize = 16;
/// Bytes after a record's frame: the clear tail's length and the tag.
pub const TRAILER_LEN: usize = 4 + TAG_LEN;
/// The frame header after its length prefix (version, kind, flags, request id): always sealed.
const SEALED_MIN: usize = netram_proto::FRAME_HEADER_LEN - 4;
/// Bytes of key material for one direction.
pub const KEY_LEN: usize = 16;
/// The largest record: the largest frame and its trailer.
pub const MAX_RECORD_LEN: usize = MAX_FRAME_LEN + TRAILER_LEN;

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

    /// Seals every frame of `buf`, each followed by [`TRAILER_LEN`] bytes of room (as
    /// [`reserve_tags`] leaves them, with a clear tail set by [`set_clear_tail`] or none), in
    /// place, in order.
    pub fn seal_all(&mut self, buf: &mut [u8]) {
        let mut at = 0;
        while at < buf.len() {
            let body = u32::from_le_bytes(buf[at..at + 4].try_into().expect("4 bytes")) as usize;
            let end = at + 4 + body;
            let tail = u32::from_le_bytes(buf[end..end + 4].try_into().expect("4 bytes"));
            assert!(
                tail as usize <= body - SEALED_MIN,
                "a clear tail leaves the frame's header sealed"
            );
            let len = ((body + TRAILER_LEN) as u32).to_le_bytes();
            buf[at..at + 4].copy_from_slice(&len);
            let aad = aad(len, tail);
            let nonce = self.next_nonce();
            let tag = self
                .key
                .seal_in_place_separate_tag(
                    nonce,
                    Aad::from(aad),
                    &mut buf[at + 4..end - tail as usize],
                )
                .expect("a frame is far below AES-GCM's message limit");
            buf[end + 4..end + TRAILER_LEN].copy_from_slice(tag.as_ref());
            at = end + TRAILER_LEN;
        }
        debug_assert_eq!(
            at,
            buf.len(),
            "frames and their trailer room fill the buffer"
        );
    }

    /// Opens the whole record `rec` (length prefix included) in place. On success its first
    /// `4 + body` bytes are the plain frame (its length prefix rewritten), and it returns the
    /// frame's length and how many bytes at its end were sent in clear (0 but for a GET
    /// reply's page data, see the module's documentation: the caller checks them). A record
    /// that does not authenticate is an error and must close the connection (the counter has
    /// moved on: nothing after it can open either).
    pub fn open(&mut self, rec: &mut [u8]) -> Result<(usize, usize), DecodeError> {
        let len: [u8; 4] = rec[..4].try_into().expect("a whole record");
        let after = rec.len() - 4;
        if after < TRAILER_LEN + SEALED_MIN {
            return Err(DecodeError::BadLength {
                len: after,
                min: TRAILER_LEN + SEALED_MIN,
                max: MAX_RECORD_LEN - 4,
            });
        }
        let body = after - TRAILER_LEN;
        let tail = u32::from_le_bytes(rec[4 + body..8 + body].try_into().expect("4 bytes"));
        let nonce = self.next_nonce();
        if tail as usize > body - SEALED_MIN {
            return Err(DecodeError::Unauthenticated);
        }
        let tag: [u8; TAG_LEN] = rec[8 + body..].try_into().expect("tag");
        self.key
            .open_in_place_separate_tag(
                nonce,
                Aad::from(aad(len, tail)),
                Tag::from(tag),
                &mut rec[4..4 + body - tail as usize],
                0..,
            )
            .map_err(|_| DecodeError::Unauthenticated)?;
        rec[..4].copy_from_slice(&(body as u32).to_le_bytes());
        Ok((4 + body, tail as usize))
    }
}

/// The associated data of a record: its length prefix and its clear tail's length.
fn aad(len: [u8; 4], tail: u32) -> [u8; 8] {
    let mut a = [0u8; 8];
    a[..4].copy_from_slice(&len);
    a[4..].copy_from_slice(&tail.to_le_bytes());
    a
}

/// Marks the last `tail` bytes of the frame at `at` in `buf` (followed by its trailer room)
/// to go in clear: the page data of a GET reply, for a client that seals its pages.
pub fn set_clear_tail(buf: &mut [u8], at: usize, tail: usize) {
    let body = u32::from_le_bytes(buf[at..at + 4].try_into().expect("a frame")) as usize;
    assert!(
        tail <= body - SEALED_MIN,
        "a clear tail leaves the header sealed"
    );
    let room = at + 4 + body;
    buf[room..room + 4].copy_from_slice(&(tail as u32).to_le_bytes());
}

/// Leaves [`TRAILER_LEN`] bytes of room after every frame of `buf` from `from` on (frames a
/// writer has just encoded there; no clear tail), for [`RecordKey::seal_all`]. One frame (the usual case) costs a
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
    buf.resize(old + n * TRAILER_LEN, 0);
    // From the last frame back, each moves by the room of the frames before it.
    let mut end = old;
    for (i, &s) in starts.iter().enumerate().rev() {
        let shift = i * TRAILER_LEN;
        if shift > 0 {
            buf.copy_within(s..end, s + shift);
        }
        // The room after this frame: zeros (no clear tail), whatever was moved out of it.
        let room = end + shift;
        buf[room..room + TRAILER_LEN].fill(0);
        end = s;
    }
}

/// How many bytes the record at the start of `buf` occupies, once its length prefix has
/// arrived: [`frame_len`] with room for the trailer.
pub fn record_len(buf: &[u8]) -> Result<Option<usize>, DecodeError> {
    let Some(prefix) = buf.get(..4) else {
        return Ok(None);
    };
    let len = u32::from_le_bytes(prefix.try_into().expect("4 bytes")) as usize + 4;
    if !(FRAME_HEADER_LEN + TRAILER_LEN..=MAX_RECORD_LEN).contains(&len) {
        return Err(DecodeError::BadLength {
            len,
            min: FRAME_HEADER_LEN + TRAILER_LEN,
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
            let (f, _) = key.open(&mut buf[at..at + n])?;
            ids.push(decode_request(&buf[at..at + f])?.0);
            at += n;
        }
        Ok(ids)
    }

    /// A GET reply whose page data goes in clear: the page may change on the way (the pager
    /// checks it against its own tag), nothing else may, nor how much of the frame is clear.
    #[test]
    fn a_clear_tail_covers_only_what_it_says() {
        use netram_proto::{begin_get_reply, decode_reply, get_reply_found, get_reply_tail};
        use netram_proto::{get_reply_data, Load, Page, PAGE_SIZE};
        let data = vec![9u8; PAGE_SIZE];
        let mut b = Vec::new();
        let mut w = begin_get_reply(&mut b, 3, Load::default(), 1);
        get_reply_found(&mut w, &Page::seal(PageKey::new(0, 1), 2, &data));
        get_reply_data(&mut w, &data);
        w.finish();
        let frame = b.clone();
        reserve_tags(&mut b, 0);
        let tail = get_reply_tail(&frame);
        assert_eq!(tail, PAGE_SIZE);
        set_clear_tail(&mut b, 0, tail);
        let k = [5u8; KEY_LEN];
        RecordKey::new(&k).seal_all(&mut b);
        let (head, rest) = (frame.len() - tail, b.len() - TRAILER_LEN);
        assert_eq!(
            &b[head..rest],
            &frame[head..],
            "the page itself went in clear"
        );
        let open = |mut r: Vec<u8>| {
            RecordKey::new(&k)
                .open(&mut r)
                .map(|(n, t)| (r[..n].to_vec(), t))
        };
        let (f, t) = open(b.clone()).unwrap();
        assert_eq!((f.as_slice(), t), (frame.as_slice(), tail));
        assert!(decode_reply(&f).is_ok());
        // A byte of the page changed: the record opens (the pager's tag catches it).
        let mut page_hit = b.clone();
        page_hit[head + 7] ^= 1;
        assert!(open(page_hit).is_ok());
        // Anything else changed: refused.
        for at in (0..head).chain(rest..b.len()) {
            let mut bad = b.clone();
            bad[at] ^= 1;
            assert!(open(bad).is_err(), "byte {at}");
        }
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
