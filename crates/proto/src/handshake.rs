//! The handshake that opens every connection: fixed-size, so that a server reads exactly
//! [`HELLO_LEN`] bytes before it has decided anything about the peer.
//!
//! The client's node id and boot incarnation make the owner of its pages (Nswap §III: IP address
//! and boot time), so that the pages of a client that restarted are recognisably dead. The
//! session id names one pager instance of that client; its lease is what the server tracks
//! (Anemone §2.5 soft-state refresh). All three are claims, not credentials: over TLS the
//! HELLO travels inside the handshake's encryption, and the server files the session under
//! the node its certificate names, so the same three from another node name another session.

use crate::codec::{DecodeError, Reader};
use crate::{NodeId, MAGIC, PROTOCOL_VERSION};

pub const HELLO_LEN: usize = 40;
pub const WELCOME_LEN: usize = 60;

/// [`Hello::flags`]: the session ends when this connection closes, however it closes (the
/// client never resumes it: a client that reconnects opens a new session). Its pages are
/// freed at once rather than when its lease runs out, so that the sessions of processes that
/// exited (or exec'd) do not pile up; the lease is left for the connections that die without
/// a word (a machine that crashed, a network cut).
pub const HELLO_END_ON_CLOSE: u16 = 1;
/// [`Hello::flags`]: this client seals every page end to end and checks each page it reads
/// against the tag it kept, so over TLS the server may leave the page data of a GET reply out
/// of the record's seal (`netram-net`'s `record.rs`: one cipher pass per page fewer on each
/// side).
pub const HELLO_SEALED_PAGES: u16 = 2;
/// Every flag this version knows; any other bit set is refused.
const HELLO_FLAGS: u16 = HELLO_END_ON_CLOSE | HELLO_SEALED_PAGES;

/// The client's opening message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    pub version: u16,
    pub node: NodeId,
    /// Grows with every restart of the client; a server that sees a newer incarnation of a node
    /// frees every page of its older ones.
    pub incarnation: u64,
    pub session: u64,
    /// [`HELLO_END_ON_CLOSE`] or nothing.
    pub flags: u16,
}

impl Hello {
    pub fn new(node: NodeId, incarnation: u64, session: u64) -> Self {
        Self {
            version: PROTOCOL_VERSION,
            node,
            incarnation,
            session,
            flags: 0,
        }
    }

    pub fn with_flags(self, flags: u16) -> Self {
        Self { flags, ..self }
    }

    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..10].copy_from_slice(&self.version.to_le_bytes());
        b[10..12].copy_from_slice(&self.flags.to_le_bytes());
        // 12..16: reserved, zero.
        b[16..24].copy_from_slice(&self.node.to_le_bytes());
        b[24..32].copy_from_slice(&self.incarnation.to_le_bytes());
        b[32..40].copy_from_slice(&self.session.to_le_bytes());
        b
    }

    /// Decodes a hello. A version other than ours is not an error here: the server answers it
    /// with [`WelcomeStatus::VersionUnsupported`] so that the client learns why.
    pub fn decode(buf: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader::new(buf);
        if r.array::<8>()? != MAGIC {
            return Err(DecodeError::BadMagic);
        }
        let version = r.u16()?;
        let flags = r.u16()?;
        if flags & !HELLO_FLAGS != 0 {
            return Err(DecodeError::Reserved {
                field: "hello flags",
                value: flags.into(),
            });
        }
        r.reserved_u32("hello reserved")?;
        let hello = Self {
            version,
            flags,
            node: r.u64()?,
            incarnation: r.u64()?,
            session: r.u64()?,
        };
        r.finish()?;
        Ok(hello)
    }
}

/// Whether the server accepted the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum WelcomeStatus {
    Ok = 0,
    /// The client speaks another protocol version; `version` in the reply is the server's.
    VersionUnsupported = 1,
    /// The server is at its connection limit.
    Busy = 2,
    /// The server's session table is full.
    TooManySessions = 3,
    /// The server has seen a newer incarnation of this node: this client is a zombie of an
    /// earlier boot, and its pages are gone.
    StaleIncarnation = 4,
}

impl WelcomeStatus {
    fn from_u16(v: u16) -> Result<Self, DecodeError> {
        Ok(match v {
            0 => Self::Ok,
            1 => Self::VersionUnsupported,
            2 => Self::Busy,
            3 => Self::TooManySessions,
            4 => Self::StaleIncarnation,
            _ => {
                return Err(DecodeError::BadValue {
                    field: "welcome status",
                    value: v.into(),
                })
            }
        })
    }
}

/// The server's answer to a [`Hello`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Welcome {
    pub version: u16,
    pub status: WelcomeStatus,
    /// Requests the client may have outstanding on this connection (Anemone's RMAP window).
    pub window: u32,
    pub server_node: NodeId,
    pub server_incarnation: u64,
    pub capacity_pages: u64,
    pub free_pages: u64,
    /// The client must refresh its session at least this often; the server frees the pages of
    /// a session silent for three periods.
    pub lease_period_ms: u32,
    pub max_frame_len: u32,
    pub max_batch: u32,
}

impl Welcome {
    pub fn encode(&self) -> [u8; WELCOME_LEN] {
        let mut b = [0u8; WELCOME_LEN];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..10].copy_from_slice(&self.version.to_le_bytes());
        b[10..12].copy_from_slice(&(self.status as u16).to_le_bytes());
        b[12..16].copy_from_slice(&self.window.to_le_bytes());
        b[16..24].copy_from_slice(&self.server_node.to_le_bytes());
        b[24..32].copy_from_slice(&self.server_incarnation.to_le_bytes());
        b[32..40].copy_from_slice(&self.capacity_pages.to_le_bytes());
        b[40..48].copy_from_slice(&self.free_pages.to_le_bytes());
        b[48..52].copy_from_slice(&self.lease_period_ms.to_le_bytes());
        b[52..56].copy_from_slice(&self.max_frame_len.to_le_bytes());
        b[56..60].copy_from_slice(&self.max_batch.to_le_bytes());
        b
    }

    pub fn decode(buf: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader::new(buf);
        if r.array::<8>()? != MAGIC {
            return Err(DecodeError::BadMagic);
        }
        let w = Self {
            version: r.u16()?,
            status: WelcomeStatus::from_u16(r.u16()?)?,
            window: r.u32()?,
            server_node: r.u64()?,
            server_incarnation: r.u64()?,
            capacity_pages: r.u64()?,
            free_pages: r.u64()?,
            lease_period_ms: r.u32()?,
            max_frame_len: r.u32()?,
            max_batch: r.u32()?,
        };
        r.finish()?;
        Ok(w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_hello_flags_are_refused() {
        let h = Hello::new(1, 2, 3).with_flags(HELLO_END_ON_CLOSE);
        assert_eq!(Hello::decode(&h.encode()), Ok(h));
        let mut b = h.encode();
        b[10] |= 4;
        assert!(matches!(
            Hello::decode(&b),
            Err(DecodeError::Reserved {
                field: "hello flags",
                ..
            })
        ));
    }
}
