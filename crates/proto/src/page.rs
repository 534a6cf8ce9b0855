//! The page envelope: a page's key, version, checksum, flags and a reserved AEAD tag.
//!
//! The checksum is crc32c over the key, the version, the flags and the data. The client computes
//! it on PUT and checks it on GET; the server stores it and hands it back untouched. Because the
//! key and version are covered, a server that returns the wrong page, or a stale version of the
//! right one, is caught just like a flipped bit.
//!
//! **A page travels without its zero tail** (issue 40, MIRAGE+ §3.4's "send less"): its data
//! is the page up to its last non-zero byte, the rest zeros by definition ([`trim`],
//! [`expand_into`]); an all-zero page carries no data and [`PageFlags::ZERO`]. The checksum is
//! over the trimmed data, so it is a function of the page alone, whichever length it came in
//! with: a server stores whole frames and trims again when it replies, and a page rebuilt by
//! parity or Reed-Solomon (a whole page) verifies against the checksum its owner computed.
//! This is what carries a pager's compressed pages at their compressed size: a sealed page is
//! ciphertext, which nothing on the way can compress, so the pager compresses before it
//! seals and leaves zeros after the ciphertext (`crates/pager/src/pager/seal.rs`).

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
    /// The page up to `PAGE_SIZE` bytes, the rest zeros ([`expand_into`]); none for a zero
    /// page.
    pub data: &'a [u8],
}

impl<'a> Page<'a> {
    /// Builds the envelope of a page to send, computing its checksum: its data trimmed of
    /// its zero tail, an all-zero page as [`PageFlags::ZERO`].
    pub fn seal(key: PageKey, version: u32, data: &'a [u8]) -> Self {
        Self::seal_with(key, version, PageFlags::default(), data)
    }

    /// [`Page::seal`] with flags (not [`PageFlags::ZERO`]: it is set when the page is zeros).
    pub fn seal_with(key: PageKey, version: u32, flags: PageFlags, data: &'a [u8]) -> Self {
        assert_eq!(data.len(), PAGE_SIZE, "a page is {PAGE_SIZE} bytes");
        assert!(!flags.is_zero(), "the zero flag is the page's to say");
        let data = trim(data);
        let flags = if data.is_empty() {
            PageFlags(flags.0 | PageFlags::ZERO)
        } else {
            flags
        };
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
        // Any length up to a page: what is missing is zeros ([`trim`]).
        if len > PAGE_SIZE || (flags.is_zero() && len != 0) {
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

/// crc32c over the key, version, flags and data trimmed of its zero tail ([`trim`]), all
/// little-endian: the same for a page and for any shorter form of it.
pub fn page_checksum(key: PageKey, version: u32, flags: PageFlags, data: &[u8]) -> u32 {
    let data = trim(data);
    let mut head = [0u8; 18];
    head[0..4].copy_from_slice(&key.region.to_le_bytes());
    head[4..12].copy_from_slice(&key.page.to_le_bytes());
    head[12..16].copy_from_slice(&version.to_le_bytes());
    head[16..18].copy_from_slice(&flags.0.to_le_bytes());
    crc32c::crc32c_append(crc32c::crc32c(&head), data)
}

/// `data` up to its last non-zero byte: how a page travels. Servers trim every page they
/// return, so the zeros are skipped 64 bytes at a time, eight words OR-ed together: 0.07 µs
/// for a page with 3.8 KiB of zeros at its end, where looking at each byte from the end took
/// 1.3 µs (measured on the development VM).
pub fn trim(data: &[u8]) -> &[u8] {
    let mut end = data.len();
    while end >= 64 {
        let words = data[end - 64..end]
            .chunks_exact(8)
            .map(|w| u64::from_ne_bytes(w.try_into().expect("8 bytes")));
        if words.fold(0, |acc, w| acc | w) != 0 {
            break;
        }
        end -= 64;
    }
    while end > 0 && data[end - 1] == 0 {
        end -= 1;
    }
    &data[..end]
}

/// Writes the page whose data (perhaps trimmed, [`trim`]) is `data` into `dst`, a whole page:
/// the data, then zeros.
pub fn expand_into(data: &[u8], dst: &mut [u8]) {
    assert!(data.len() <= dst.len(), "page data longer than a page");
    let (head, tail) = dst.split_at_mut(data.len());
    head.copy_from_slice(data);
    tail.fill(0);
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

    /// A page with a zero tail travels without it, and its checksum holds for the whole page
    /// as for the trimmed one (a server stores the whole page; parity rebuilds it whole).
    #[test]
    fn a_zero_tail_stays_behind_and_the_checksum_does_not_care() {
        let mut data = vec![0u8; PAGE_SIZE];
        data[..100].fill(9);
        let p = Page::seal(PageKey::new(1, 2), 3, &data);
        assert_eq!(p.data.len(), 100);
        assert!(p.verify());
        assert!(Page { data: &data, ..p }.verify(), "the whole page");
        assert!(
            Page {
                data: &data[..2000],
                ..p
            }
            .verify(),
            "another length"
        );
        assert!(
            !Page {
                data: &data[..99],
                ..p
            }
            .verify(),
            "a byte short"
        );
        let mut back = vec![7u8; PAGE_SIZE];
        expand_into(p.data, &mut back);
        assert_eq!(back, data);
        let zero = Page::seal(PageKey::new(1, 2), 3, &ZEROS);
        assert!(zero.flags.is_zero() && zero.data.is_empty() && zero.verify());
        let full = vec![1u8; PAGE_SIZE];
        assert_eq!(
            Page::seal(PageKey::new(1, 2), 3, &full).data.len(),
            PAGE_SIZE
        );
    }

    /// Whatever the page, the trimmed data ends where its last non-zero byte is.
    #[test]
    fn trim_ends_at_the_last_non_zero_byte() {
        for last in [0, 1, 7, 8, 63, 64, 65, 127, 128, 4031, 4032, 4095] {
            let mut d = vec![0u8; PAGE_SIZE];
            d[last] = 1;
            d[0] = 2;
            assert_eq!(trim(&d).len(), last + 1, "{last}");
        }
        assert!(trim(&ZEROS).is_empty());
        assert_eq!(trim(&[0, 5, 0, 0, 0]), &[0, 5]);
    }

    static ZEROS: [u8; PAGE_SIZE] = [0; PAGE_SIZE];
}
