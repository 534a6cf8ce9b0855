//! End-to-end page sealing: GMS's answer to its own open problem (paper 000 §6: a node must
//! trust every other not to read or corrupt the pages it holds; "encrypt pages on their way to
//! and from global memory"). A page leaves this pager as AES-128-GCM ciphertext under a key
//! that never leaves it, and comes back only if it authenticates.
//!
//! * **What is sealed where.** A page is sealed in place in its slot when its write-back
//!   begins ([`Pager::begin_writeback`]) and stays ciphertext while it is in flight, so every
//!   scheme works on ciphertext: mirrors send the same bytes to every server, parity XORs
//!   ciphertexts, Reed-Solomon encodes them, and whatever a scheme rebuilds is ciphertext that
//!   must authenticate before anyone reads it. Outside write-back, slots hold plaintext (the
//!   cache, reads, the local disk); `Pager::sealed` records which slots hold ciphertext and
//!   `check_invariants` checks it.
//! * **Nonce and associated data.** The nonce is the page number and its version (12 bytes):
//!   versions never go back, even across discards (`table.rs`), and one key serves one pager,
//!   so no nonce is ever used twice with different data (a page sent twice at one version is
//!   the same bytes, sealed to the same ciphertext). The associated data is the region, the
//!   page and the version: a server that returns another page, or an old version of this one,
//!   fails authentication exactly as a flipped bit does.
//! * **Where the tag lives.** In the page table, beside the version: 16 bytes a page on the
//!   client rather than on every server. A rebuilt page (parity, Reed-Solomon, another copy)
//!   then authenticates against the tag its owner kept, not against anything a server kept,
//!   and no scheme has to carry tags through its arithmetic. The cost is 16 bytes of table per
//!   page written (0.4 % of the data), allocated zeroed like the table, so resident only for
//!   the pages in use.
//! * **Why AES-128-GCM from `ring`.** Measured on the development VM (AES-NI, VAES, 4 KiB):
//!   `ring`'s AES-128-GCM seals or opens a page in 0.35 µs (AES-256-GCM 0.41 µs), its
//!   ChaCha20-Poly1305 in 1.7 µs, the `chacha20poly1305` crate's XChaCha20-Poly1305 in 4 µs
//!   and the `aes-gcm` crate in 2.4 µs, against a GET round trip of ~7 µs in the low-latency
//!   mode: only `ring`'s AES-GCM fits the 10 % the issue allows, and 128-bit keys (TLS 1.3's
//!   first suite) are enough for memory that lives as long as its pager. The crc32c stays on the wire (over the ciphertext) so a
//!   server still refuses a page damaged on the way, and for pagers that do not seal.
//! * **Compressed, then sealed** (MIRAGE+, paper 002, §3.4; issue 40: compression offered to
//!   the pager's PUTs). Ciphertext does not compress, so nothing after the seal can shrink a
//!   page: when the pager is given a rule (`PagerConfig::compress`, the link's speed against
//!   the codec's measured cost, `netram_proto::compress::Rule`) a page that LZ4 shrinks by
//!   enough to pay is sealed as its LZ4 block, at the start of its slot, and the rest of the
//!   slot is zeroed. A page travels without its zero tail (`netram_proto::page::trim`), so
//!   what goes on the wire is the ciphertext of the block; servers keep whole frames, parity
//!   XORs and Reed-Solomon encodes whole slots as before. The block's length is kept here
//!   beside the tag (two bytes a page, only when compressing) and is in the associated data.
//!   A page that does not shrink enough is sealed whole, as without a rule; each outcome is
//!   counted (`pages_compressed`, `pages_compress_aborted`, `pages_compress_not_worth`).
//!   What it costs in secrecy: a server sees how long each compressed page is, which says
//!   something of its contents (how repetitive it is). That is why it is off unless asked
//!   for, and the reason to leave it off where servers are not trusted with that much.

use crate::writeback::Writeback;
use crate::{Disk, Pager, Transport};
use netram_proto::compress::{Packed, Rule, Skip, PACKED_ROOM};
use netram_proto::PAGE_SIZE;
use ring::aead::{Aad, LessSafeKey, Nonce, Tag, UnboundKey, AES_128_GCM};
use std::fmt;

/// Bytes of a page-sealing key.
pub const SEAL_KEY_LEN: usize = 16;
/// Bytes of the tag kept per page.
pub const SEAL_TAG_LEN: usize = 16;

/// The key a pager seals its pages with. It never leaves the pager: not on the wire, not in a
/// log (its `Debug` prints nothing of it).
#[derive(Clone, PartialEq, Eq)]
pub struct SealKey(pub [u8; SEAL_KEY_LEN]);

impl SealKey {
    /// A fresh key from the operating system's random source: what every pager starts with
    /// unless it is told otherwise (a simulation passes its own, from its seed).
    pub fn random() -> Self {
        use ring::rand::SecureRandom;
        let mut k = [0u8; SEAL_KEY_LEN];
        ring::rand::SystemRandom::new()
            .fill(&mut k)
            .expect("the operating system's random source");
        Self(k)
    }
}

impl fmt::Debug for SealKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SealKey(..)")
    }
}

/// A page's seal: its key, the tag of every page's current version, and what was sealed.
pub(crate) struct Sealer {
    key: LessSafeKey,
    region: u32,
    /// By page: the tag of its current version (zeros before its first write-out).
    tags: Vec<[u8; SEAL_TAG_LEN]>,
    /// When pages are compressed before they are sealed: the rule that says when it pays.
    rule: Option<Rule>,
    /// By page, with a rule: the length of its current version's LZ4 block, 0 when it was
    /// sealed whole. Empty without a rule.
    packed: Vec<u16>,
    /// Whether any page was sealed yet: the rule is fixed from then on (`set_rule`).
    sealed_any: bool,
}

/// What became of a page sealed with a compression rule (for the counters).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shrunk {
    /// Sealed as its LZ4 block of this many bytes.
    To(usize),
    /// Sealed whole, and why.
    Not(Skip),
}

impl fmt::Debug for Sealer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sealer")
            .field("region", &self.region)
            .finish_non_exhaustive()
    }
}

impl Sealer {
    pub(crate) fn new(key: &SealKey, region: u32, pages: u64, rule: Option<Rule>) -> Self {
        let key = UnboundKey::new(&AES_128_GCM, &key.0).expect("a 16-byte AES-128 key");
        Self {
            key: LessSafeKey::new(key),
            region,
            tags: bytemuck::zeroed_vec(pages as usize),
            rule,
            packed: if rule.is_some() {
                vec![0; pages as usize]
            } else {
                Vec::new()
            },
            sealed_any: false,
        }
    }

    fn nonce(page: u64, version: u32) -> Nonce {
        let mut n = [0u8; 12];
        n[..8].copy_from_slice(&page.to_le_bytes());
        n[8..].copy_from_slice(&version.to_le_bytes());
        Nonce::assume_unique_for_key(n)
    }

    /// Compresses by `rule`, or never; false, and nothing changed, once a page was sealed.
    /// Why: a page may be sealed again at the same version (a write-back that went to the
    /// disk or the cache and out again), under the same nonce, and AES-GCM stays safe only if
    /// it is the same plaintext then — the same page compressed by the same rule.
    pub(crate) fn set_rule(&mut self, rule: Option<Rule>) -> bool {
        if self.sealed_any {
            return false;
        }
        if rule.is_some() && self.packed.is_empty() {
            self.packed = vec![0; self.tags.len()];
        }
        self.rule = rule;
        true
    }

    /// The region, the page, the version and the length of the LZ4 block sealed (0: the
    /// page whole).
    fn aad(&self, page: u64, version: u32, packed: usize) -> [u8; 18] {
        let mut a = [0u8; 18];
        a[..4].copy_from_slice(&self.region.to_le_bytes());
        a[4..12].copy_from_slice(&page.to_le_bytes());
        a[12..16].copy_from_slice(&version.to_le_bytes());
        a[16..].copy_from_slice(&(packed as u16).to_le_bytes());
        a
    }

    /// Encrypts `data` (one page) in place as `version` of `page` and keeps its tag: with a
    /// rule, as its LZ4 block followed by zeros when that pays. What became of it, with a
    /// rule.
    pub(crate) fn seal(&mut self, page: u64, version: u32, data: &mut [u8]) -> Option<Shrunk> {
        debug_assert_eq!(data.len(), PAGE_SIZE);
        let shrunk = self.rule.map(|rule| {
            // On the stack: the pager's slots are borrowed by the caller, and a page's worth
            // of stack is nothing to a thread that handles faults.
            let mut block = [0u8; PACKED_ROOM];
            match rule.pack_data(data, &mut block) {
                Packed::Compressed(n) => {
                    data[..n].copy_from_slice(&block[..n]);
                    data[n..].fill(0);
                    Shrunk::To(n)
                }
                Packed::Raw(why) => Shrunk::Not(why),
                Packed::Zero => unreachable!("pack_data compresses zero pages too"),
            }
        });
        let n = match shrunk {
            Some(Shrunk::To(n)) => n,
            _ => 0,
        };
        self.sealed_any = true;
        if let Some(p) = self.packed.get_mut(page as usize) {
            *p = n as u16;
        }
        let aad = self.aad(page, version, n);
        let sealed = if n > 0 { &mut data[..n] } else { data };
        let tag = self
            .key
            .seal_in_place_separate_tag(Self::nonce(page, version), Aad::from(aad), sealed)
            .expect("a page is far below AES-GCM's message limit");
        self.tags[page as usize].copy_from_slice(tag.as_ref());
        shrunk
    }

    /// Decrypts `data` (one page) in place if it is `version` of `page` as this pager sealed
    /// it, decompressing it if it was sealed compressed; false (and `data` left unusable)
    /// otherwise.
    pub(crate) fn open(&self, page: u64, version: u32, data: &mut [u8]) -> bool {
        debug_assert_eq!(data.len(), PAGE_SIZE);
        let n = self
            .packed
            .get(page as usize)
            .map_or(0, |&n| usize::from(n));
        let aad = self.aad(page, version, n);
        let tag = Tag::from(self.tags[page as usize]);
        let sealed = if n > 0 { &mut data[..n] } else { &mut *data };
        let ok = self
            .key
            .open_in_place_separate_tag(
                Self::nonce(page, version),
                Aad::from(aad),
                tag,
                sealed,
                0..,
            )
            .is_ok();
        if !ok || n == 0 {
            return ok;
        }
        // The block authenticated: it is what this pager compressed, so it decompresses (an
        // error here would be this pager's own bug, refused all the same).
        let mut block = [0u8; PAGE_SIZE];
        block[..n].copy_from_slice(&data[..n]);
        netram_proto::compress::unpack(&block[..n], data).is_ok()
    }
}

impl<T: Transport, D: Disk> Pager<T, D> {
    /// Starts the write-back of `page` from `wb.slot`, which holds its plaintext: sealed in
    /// place first, so that everything sent from it, copied, XORed or encoded is ciphertext.
    /// (What a scheme rebuilds is opened before it gets here: it authenticates, or it is not
    /// written back.)
    pub(crate) fn begin_writeback(&mut self, page: u64, wb: Writeback) {
        if let Some(s) = &mut self.sealer {
            let at = wb.slot as usize * PAGE_SIZE;
            assert!(
                !self.sealed[wb.slot as usize],
                "slot {} sealed twice",
                wb.slot
            );
            match s.seal(page, wb.version, &mut self.slots[at..at + PAGE_SIZE]) {
                Some(Shrunk::To(n)) => {
                    self.counters.pages_compressed += 1;
                    self.counters.bytes_saved_compressing += (PAGE_SIZE - n) as u64;
                }
                Some(Shrunk::Not(Skip::Aborted)) => self.counters.pages_compress_aborted += 1,
                Some(Shrunk::Not(Skip::LinkFast)) => self.counters.pages_compress_not_worth += 1,
                None => {}
            }
            self.sealed[wb.slot as usize] = true;
        }
        self.writeback.insert(page, wb);
    }

    /// Opens the ciphertext of `version` of `page` in `slot` in place; false when it does not
    /// authenticate (counted). Without a seal, slots hold plaintext and this is true.
    pub(crate) fn unseal_slot(&mut self, page: u64, version: u32, slot: u32) -> bool {
        let Some(s) = &self.sealer else {
            return true;
        };
        let at = slot as usize * PAGE_SIZE;
        let ok = s.open(page, version, &mut self.slots[at..at + PAGE_SIZE]);
        if ok {
            self.sealed[slot as usize] = false;
        } else {
            self.counters.page_auth_failures += 1;
        }
        ok
    }

    /// Copies `version` of `page` out of `slot` into `dst` as plaintext: a write-back's slot is
    /// opened on the way (it authenticates: this pager sealed it).
    pub(crate) fn copy_plain(&self, page: u64, version: u32, slot: u32, dst: &mut [u8]) {
        dst.copy_from_slice(self.slot(slot));
        if self.sealed[slot as usize] {
            let s = self.sealer.as_ref().expect("sealed slots only with a seal");
            assert!(
                s.open(page, version, dst),
                "page {page} v{version}: its own write-back slot does not authenticate"
            );
        }
    }

    /// A write-back's slot about to go to the local disk or back to the cache: opened to
    /// plaintext (the disk and the cache hold plaintext).
    pub(crate) fn unseal_own(&mut self, page: u64, version: u32, slot: u32) {
        if self.sealed[slot as usize] {
            assert!(
                self.unseal_slot(page, version, slot),
                "page {page} v{version}: its own write-back slot does not authenticate"
            );
        }
    }
}
