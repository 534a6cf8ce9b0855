//! The page envelope: a page's key, version, checksum, flags and a reserved AEAD tag.
//!
//! The checksum is crc32c over the key, the version, the flags and the data. The client computes
//! it on PUT and checks it on GET; the server stores it and hands it back untouched. Because the
//! key and version are covered, a server that returns the wrong page, or a stale version of the
//! right one, is caught just like a flipped bit.

use crate::codec::{DecodeError, FrameBuilder, Reader};
use crate::PAGE_SIZE;

/// Bytes of the envelope before the page data.
pub const ENVELOPE_LEN: usize = 40;

/// Room for an authenticated-encryption tag (AES-GCM, ChaCha20-Poly1305: 16 bytes). Zero until
/// encryption lands; the decoder passes it through so that old and new peers agree on the layout.
pub const TAG_LEN: usize = 16;

/// Which page of a session: a region of the owner (an NBD device, a userfaultfd region) and a
/// page number inside it. The owner's node id and incarnation come from the session's handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageKey {
    pub region: u32,
    pub page: u64,
}

impl PageKey {
    pub const WIRE_LEN: usize = 12;

    pub fn new(region: u32, page: u64) -> Self {
        Self { region, page }
    }

    pub(crate) fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        Ok(Self {
            region: r.u32()?,
            page: r.u64()?,
        })
    }

    pub(crate) fn encode(&self, w: &mut FrameBuilder<'_>) {
        w.u32(self.region).u64(self.page);
    }
}

/// Flags of a page envelope. Unknown bits are refused, so that a peer never silently ignores a
/// transformation (compression, encryption) it does not understand.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PageFlags(pub u16);

impl PageFlags {
    /// The page is all zeros and carries no data (MIRAGE+ and zswap send zero pages as a flag).
    pub const ZERO: u16 = 1 << 0;
    /// The owner keeps this version on its own disk too (`cluster+disk` backing): the copy
    /// here is a *clean* page in GMS's sense (paper 000, §4.5), which a server out of frames
    /// may drop, the globally oldest first, instead of refusing a page; its owner then reads
    /// it from its disk.
    pub const CLEAN: u16 = 1 << 1;
    /// The data is the page in LZ4's block format (DSM's page transfers only,
    /// `crate::dsm`; [`crate::compress`]).
    pub const LZ4: u16 = 1 << 2;
    /// The flags a pager's page may carry.
    pub const KNOWN: u16 = Self::ZERO | Self::CLEAN;

    pub fn is_zero(self) -> bool {
        self.0 & Self::ZERO != 0
    }

    pub fn is_clean(self) -> bool {
        self.0 & Self::CLEAN != 0
    }

    pub fn is_lz4(self) -> bool {
        self.0 & Self::LZ4 != 0
    }

    /// How a page's contents travel: an all-zero page as the flag and no data, any other as
    /// it is.
    pub fn zero_or(data: &[u8]) -> (Self, &[u8]) {
        if data.iter().all(|&b| b == 0) {
            (Self(Self::ZERO), &data[..0])
        } else {
            (Self::default(), data)
        }
    }
}

/// One page as it travels: in a PUT from the client, in a GET reply from the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Page<'a> {
    pub key: PageKey,
    /// Incremented by the owner on every write-out; settles races between write-outs,
    /// migrations and garbage collection (Nswap §III).
    pub version: u32,
    /// [`page_checksum`] of key, version, flags and data, computed by the client.
    pub crc: u32,
    pub flags: PageFlags,
    pub tag: [u8; TAG_LEN],
    /// `PAGE_SIZE` bytes, or none for a zero page.
    pub data: &'a [u8],
}

impl<'a> Page<'a> {
    /// Builds the envelope of a page to send, computing its checksum.
    pub fn seal(key: PageKey, version: u32, data: &'a [u8]) -> Self {
        Self::seal_with(key, version, PageFlags::default(), data)
    }

    /// [`Page::seal`] with flags (not [`PageFlags::ZERO`]: the data is always a whole page).
    pub fn seal_with(key: PageKey, version: u32, flags: PageFlags, data: &'a [u8]) -> Self {
        assert_eq!(data.len(), PAGE_SIZE, "a page is {PAGE_SIZE} bytes");
        assert!(!flags.is_zero(), "a sealed page carries its data");
        Self {
            key,
            version,
            crc: page_checksum(key, version, flags, data),
            flags,
            tag: [0; TAG_LEN],
            data,
        }
    }

    /// True when the checksum matches the contents: the receiving client's check.
    pub fn verify(&self) -> bool {
        self.crc == page_checksum(self.key, self.version, self.flags, self.data)
    }

    pub(crate) fn decode(r: &mut Reader<'a>) -> Result<Self, DecodeError> {
        let (mut page, len) = Self::decode_header(r)?;
        page.data = r.bytes(len)?;
        Ok(page)
    }

    /// The envelope without its data (as a GET reply's entry carries it), and how many bytes
    /// of data belong to it.
    pub(crate) fn decode_header(r: &mut Reader<'_>) -> Result<(Self, usize), DecodeError> {
        let key = PageKey::decode(r)?;
        let version = r.u32()?;
        let crc = r.u32()?;
        let flags = r.u16()?;
        if flags & !PageFlags::KNOWN != 0 {
            return Err(DecodeError::Reserved {
                field: "page flags",
                value: flags.into(),
            });
        }
        let flags = PageFlags(flags);
        let len = r.u16()? as usize;
        let expected = if flags.is_zero() { 0 } else { PAGE_SIZE };
        if len != expected {
            return Err(DecodeError::BadPageLength {
                len,
                flags: flags.0,
            });
        }
        let tag = r.array()?;
        Ok((
            Self {
                key,
                version,
                crc,
                flags,
                tag,
                data: &[],
            },
            len,
        ))
    }

    pub(crate) fn encode(&self, w: &mut FrameBuilder<'_>) {
        self.encode_header(w);
        w.bytes(self.data);
    }

    /// The envelope without its data.
    pub(crate) fn encode_header(&self, w: &mut FrameBuilder<'_>) {
        self.key.encode(w);
        w.u32(self.version)
            .u32(self.crc)
            .u16(self.flags.0)
            .u16(self.data.len() as u16)
            .bytes(&self.tag);
    }
}

/// crc32c over the key, version, flags and data, all little-endian.
pub fn page_checksum(key: PageKey, version: u32, flags: PageFlags, data: &[u8]) -> u32 {
    let mut head = [0u8; 18];
    head[0..4].copy_from_slice(&key.region.to_le_bytes());
    head[4..12].copy_from_slice(&key.page.to_le_bytes());
    head[12..16].copy_from_slice(&version.to_le_bytes());
    head[16..18].copy_from_slice(&flags.0.to_le_bytes());
    crc32c::crc32c_append(crc32c::crc32c(&head), data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksum_covers_key_version_and_data() {
        let data = vec![7u8; PAGE_SIZE];
        let p = Page::seal(PageKey::new(1, 2), 3, &data);
        assert!(p.verify());
        let moved = Page {
            key: PageKey::new(1, 3),
            ..p
        };
        assert!(!moved.verify(), "a page returned under another key");
        let stale = Page { version: 2, ..p };
        assert!(!stale.verify(), "an older version");
        let mut flipped = data.clone();
        flipped[100] ^= 1;
        let corrupt = Page {
            data: &flipped,
            ..p
        };
        assert!(!corrupt.verify(), "a flipped bit");
    }
}
