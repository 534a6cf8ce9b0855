//! The bytes of one membership packet (UDP): the sender's resource announcement (Anemone §2.4:
//! free capacity and load ride on every message), foca's SWIM message, and, between nodes of a
//! secure cluster, the sender's certificate and its signature over all of it.
//!
//! ```text
//! packet   = magic "NRMB" | version:u8 | flags:u8 | sent_ms:u64 | announce | [from:u64]
//!            len:u16 | message
//!            [ cert_len:u16 | cert | scheme:u16 | sig_len:u16 | sig ]     (flags & SIGNED)
//! announce = seq:u64 | offered_pages:u64 | free_pages:u64 | requests_per_s:u32
//! ```
//!
//! The message is foca's SWIM message, or, with the flag GMS, one of GMS's epoch messages
//! between daemons (`netram_proto::gms`, a whole frame), which then names the node that sends
//! it (`from`: in a secure cluster the receiver holds it against the certificate). Epoch
//! messages ride here rather than on the pages' TCP connections because this channel already
//! is what they need: every member's address, a signature naming the sending node on every
//! packet, a rate gate per address; and they are small (under 1 KiB) and may be lost (an
//! epoch tolerates a missing summary or plan, GMS §3.2).
//!
//! The signature covers every byte before `scheme`. Hand-written rather than serde: the
//! signature must cover the exact bytes received, and a decoder this small is easier to
//! fuzz than to configure. Everything here is hostile input: lengths are checked against the
//! packet before anything is read, nothing is allocated from a length the sender gives.

/// Packets longer than this are refused unread (foca's packets stay under its
/// `max_packet_size`; a certificate and a signature add under 1 KiB).
pub const MAX_PACKET: usize = 4096;
const MAGIC: &[u8; 4] = b"NRMB";
const VERSION: u8 = 1;
const SIGNED: u8 = 1;
const GMS: u8 = 2;
const HEAD_LEN: usize = 4 + 1 + 1 + 8 + ANNOUNCE_LEN + 2;
const ANNOUNCE_LEN: usize = 8 + 8 + 8 + 4;

/// What a node says of itself in every packet it sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Announce {
    /// Grows with every change; a receiver keeps the newest it has seen from each node.
    pub seq: u64,
    /// Pages the node offers the cluster now (its donor's offer).
    pub offered_pages: u64,
    /// Pages a new page may still take.
    pub free_pages: u64,
    /// Requests it served in the last second.
    pub requests_per_s: u32,
}

/// A decoded packet; slices borrow from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packet<'a> {
    pub sent_ms: u64,
    pub announce: Announce,
    /// foca's message, for `Membership::on_packet`; or, when `gms_from` is set, a GMS epoch
    /// message (a `netram_proto::gms` frame).
    pub swim: &'a [u8],
    /// The node a GMS epoch message says it comes from; `None` for a SWIM message.
    pub gms_from: Option<u64>,
    pub signature: Option<Signature<'a>>,
}

/// The proof of who sent a packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signature<'a> {
    /// The sender's certificate (DER).
    pub cert: &'a [u8],
    /// A TLS `SignatureScheme` number.
    pub scheme: u16,
    pub sig: &'a [u8],
    /// The bytes the signature covers.
    pub signed: &'a [u8],
}

/// Why a packet was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum EnvelopeError {
    #[error("{0} bytes, over the {MAX_PACKET}-byte limit")]
    TooLong(usize),
    #[error("cut short")]
    Short,
    #[error("not a netram membership packet")]
    BadMagic,
    #[error("membership version {0}, this node speaks {VERSION}")]
    BadVersion(u8),
    #[error("unknown flags {0:#x}")]
    BadFlags(u8),
    #[error("bytes after the packet's end")]
    Trailing,
}

/// Appends the part of a packet that a signature covers.
pub fn encode_body(out: &mut Vec<u8>, sent_ms: u64, a: &Announce, swim: &[u8], signed: bool) {
    encode(out, sent_ms, a, None, swim, signed);
}

/// Appends the part of a packet carrying GMS epoch message `frame` from node `from` that a
/// signature covers.
pub fn encode_gms_body(
    out: &mut Vec<u8>,
    sent_ms: u64,
    a: &Announce,
    from: u64,
    frame: &[u8],
    signed: bool,
) {
    encode(out, sent_ms, a, Some(from), frame, signed);
}

fn encode(
    out: &mut Vec<u8>,
    sent_ms: u64,
    a: &Announce,
    gms_from: Option<u64>,
    message: &[u8],
    signed: bool,
) {
    out.extend_from_slice(MAGIC);
    out.push(VERSION);
    out.push(if signed { SIGNED } else { 0 } | if gms_from.is_some() { GMS } else { 0 });
    out.extend_from_slice(&sent_ms.to_le_bytes());
    out.extend_from_slice(&a.seq.to_le_bytes());
    out.extend_from_slice(&a.offered_pages.to_le_bytes());
    out.extend_from_slice(&a.free_pages.to_le_bytes());
    out.extend_from_slice(&a.requests_per_s.to_le_bytes());
    if let Some(from) = gms_from {
        out.extend_from_slice(&from.to_le_bytes());
    }
    out.extend_from_slice(&(message.len() as u16).to_le_bytes());
    out.extend_from_slice(message);
}

/// Appends the certificate of a signed body; the bytes signed are then everything so far.
pub fn encode_cert(out: &mut Vec<u8>, cert: &[u8]) {
    out.extend_from_slice(&(cert.len() as u16).to_le_bytes());
    out.extend_from_slice(cert);
}

/// Appends the signature over everything before it.
pub fn encode_signature(out: &mut Vec<u8>, scheme: u16, sig: &[u8]) {
    out.extend_from_slice(&scheme.to_le_bytes());
    out.extend_from_slice(&(sig.len() as u16).to_le_bytes());
    out.extend_from_slice(sig);
}

struct Cursor<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], EnvelopeError> {
        let end = self.at.checked_add(n).ok_or(EnvelopeError::Short)?;
        let s = self.buf.get(self.at..end).ok_or(EnvelopeError::Short)?;
        self.at = end;
        Ok(s)
    }
    fn u16(&mut self) -> Result<u16, EnvelopeError> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }
    fn u32(&mut self) -> Result<u32, EnvelopeError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64, EnvelopeError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
}

/// Reads a packet. Checks its shape only; who signed it is the caller's to check
/// (`netram_net::Credentials::verify_signed`).
pub fn decode(buf: &[u8]) -> Result<Packet<'_>, EnvelopeError> {
    if buf.len() > MAX_PACKET {
        return Err(EnvelopeError::TooLong(buf.len()));
    }
    if buf.len() < HEAD_LEN {
        return Err(EnvelopeError::Short);
    }
    let mut c = Cursor { buf, at: 0 };
    if c.take(4)? != MAGIC {
        return Err(EnvelopeError::BadMagic);
    }
    let version = c.take(1)?[0];
    if version != VERSION {
        return Err(EnvelopeError::BadVersion(version));
    }
    let flags = c.take(1)?[0];
    if flags & !(SIGNED | GMS) != 0 {
        return Err(EnvelopeError::BadFlags(flags));
    }
    let sent_ms = c.u64()?;
    let announce = Announce {
        seq: c.u64()?,
        offered_pages: c.u64()?,
        free_pages: c.u64()?,
        requests_per_s: c.u32()?,
    };
    let gms_from = if flags & GMS != 0 {
        Some(c.u64()?)
    } else {
        None
    };
    let n = c.u16()? as usize;
    let swim = c.take(n)?;
    let signature = if flags & SIGNED != 0 {
        let n = c.u16()? as usize;
        let cert = c.take(n)?;
        let signed = &buf[..c.at];
        let scheme = c.u16()?;
        let n = c.u16()? as usize;
        let sig = c.take(n)?;
        Some(Signature {
            cert,
            scheme,
            sig,
            signed,
        })
    } else {
        None
    };
    if c.at != buf.len() {
        return Err(EnvelopeError::Trailing);
    }
    Ok(Packet {
        sent_ms,
        announce,
        swim,
        gms_from,
        signature,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample(signed: bool) -> Vec<u8> {
        let a = Announce {
            seq: 7,
            offered_pages: 1000,
            free_pages: 400,
            requests_per_s: 12,
        };
        let mut out = Vec::new();
        encode_body(&mut out, 99, &a, b"swim!", signed);
        if signed {
            encode_cert(&mut out, b"CERT");
            encode_signature(&mut out, 0x0403, b"SIG");
        }
        out
    }

    #[test]
    fn round_trip_clear_and_signed() {
        let clear = sample(false);
        let p = decode(&clear).unwrap();
        assert_eq!(
            (p.sent_ms, p.swim, p.announce.free_pages),
            (99, &b"swim!"[..], 400)
        );
        assert!(p.signature.is_none());
        assert_eq!(p.gms_from, None);
        let signed = sample(true);
        let p = decode(&signed).unwrap();
        let s = p.signature.unwrap();
        assert_eq!(
            (s.cert, s.scheme, s.sig),
            (&b"CERT"[..], 0x0403, &b"SIG"[..])
        );
        // The signature covers everything up to the scheme: the certificate included.
        assert_eq!(s.signed, &signed[..signed.len() - 2 - 2 - 3]);
    }

    /// A GMS epoch message names its sender, and the signature covers the name.
    #[test]
    fn gms_messages_round_trip() {
        let a = Announce::default();
        for signed in [false, true] {
            let mut out = Vec::new();
            encode_gms_body(&mut out, 5, &a, 0xabcd, b"frame", signed);
            if signed {
                encode_cert(&mut out, b"C");
                encode_signature(&mut out, 1, b"S");
            }
            let p = decode(&out).unwrap();
            assert_eq!((p.gms_from, p.swim), (Some(0xabcd), &b"frame"[..]));
            if let Some(s) = p.signature {
                assert!(s.signed.windows(8).any(|w| w == 0xabcdu64.to_le_bytes()));
            }
        }
    }

    #[test]
    fn refusals() {
        let mut p = sample(true);
        assert_eq!(decode(&p[..p.len() - 1]), Err(EnvelopeError::Short));
        p.push(0);
        assert_eq!(decode(&p), Err(EnvelopeError::Trailing));
        let mut p = sample(false);
        p[0] = b'X';
        assert_eq!(decode(&p), Err(EnvelopeError::BadMagic));
        let mut p = sample(false);
        p[4] = 9;
        assert_eq!(decode(&p), Err(EnvelopeError::BadVersion(9)));
        let mut p = sample(false);
        p[5] = 0x80;
        assert_eq!(decode(&p), Err(EnvelopeError::BadFlags(0x80)));
        // A SWIM packet read as a GMS one is cut short or misread, never past its end.
        let mut p = sample(false);
        p[5] = GMS;
        assert!(decode(&p).is_err());
        assert_eq!(
            decode(&vec![0; MAX_PACKET + 1]),
            Err(EnvelopeError::TooLong(MAX_PACKET + 1))
        );
    }

    proptest! {
        /// Hostile bytes decode to an error or to a packet whose parts lie inside them.
        #[test]
        fn hostile_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode(&bytes);
        }

        #[test]
        fn every_flipped_byte_is_seen_or_harmless(i in 0usize..60, bit in 0u8..8) {
            let mut p = sample(true);
            let i = i % p.len();
            p[i] ^= 1 << bit;
            if let Ok(d) = decode(&p) {
                // A change the decoder cannot see is one the signature covers, or the
                // signature itself.
                let s = d.signature.expect("the flags byte still says signed");
                prop_assert!(i < s.signed.len() || i >= p.len() - 3 - 4);
            }
        }
    }
}
