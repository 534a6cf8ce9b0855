//! Page compression that gives up when it does not pay (MIRAGE+, paper 002, §3.4 and §4.8;
//! issue 40): for DSM's page transfers, and offered to the pager's PUTs.
//!
//! MIRAGE+ compressed a page only when that removed whole network packets (below 75 % of a
//! page), and its codec aborted as soon as it could not get there. Over TCP every byte saved
//! counts, but the codec's time is paid on every page: compressing pays when the wire time of
//! the bytes saved exceeds the time to compress and decompress. So [`Rule`] takes the link's
//! measured speed and the codec's measured cost per page ([`calibrate`]) and turns them into a
//! budget: a page is sent compressed only if it fits in `PAGE_SIZE - min_saving` bytes, and
//! is sent as it is otherwise (the abort: LZ4 runs over the whole page, since its block
//! encoder wants room for its worst case, and its result is dropped — a page costs the codec
//! a few microseconds either way, which [`calibrate`] measures). A zero page never reaches
//! the codec: it travels as a flag ([`Packed::Zero`]). On loopback, where a page's wire time is below the codec's, the
//! budget is empty and nothing but zero pages is ever compressed.
//!
//! LZ4's block format (the `lz4_flex` crate, pure Rust): fast enough that a page costs a few
//! microseconds. zstd compresses better but its complete encoders need a C toolchain.

use crate::codec::DecodeError;
use crate::PAGE_SIZE;
use std::time::Instant;

/// When compressing a page pays.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rule {
    /// The link's speed, bytes a microsecond (measured by whoever sends: a round trip and a
    /// transfer time).
    pub link_bytes_per_us: f64,
    /// The codec's cost for one page, compress and decompress, microseconds ([`calibrate`]).
    pub codec_us: f64,
}

/// What became of a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Packed {
    /// All zeros: sent as a flag, no data.
    Zero,
    /// Compressed into the first `n` bytes of the output.
    Compressed(usize),
    /// Sent as it is, and why.
    Raw(Skip),
}

/// Why a page went uncompressed (one counter each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skip {
    /// The link is fast enough that no saving would repay the codec's time.
    LinkFast,
    /// The codec could not get under the budget, and stopped there.
    Aborted,
}

impl Rule {
    /// Bytes a page must shrink by for compressing it to pay.
    pub fn min_saving(&self) -> usize {
        let b = (self.codec_us * self.link_bytes_per_us).ceil();
        if b.is_finite() && b >= 0.0 {
            (b as usize).max(1)
        } else {
            usize::MAX
        }
    }

    /// The most a compressed page may take; `None` when compressing never pays.
    pub fn budget(&self) -> Option<usize> {
        // LZ4 needs a few bytes even for the most compressible page.
        PAGE_SIZE
            .checked_sub(self.min_saving())
            .filter(|&b| b >= 16)
    }

    /// Packs `page` into `out` (at least [`PACKED_ROOM`] bytes) by the rule.
    pub fn pack(&self, page: &[u8], out: &mut [u8]) -> Packed {
        assert_eq!(page.len(), PAGE_SIZE, "a page is {PAGE_SIZE} bytes");
        if page.iter().all(|&b| b == 0) {
            return Packed::Zero;
        }
        self.pack_data(page, out)
    }

    /// [`Rule::pack`] for a sender that has no flag for a zero page (the pager seals what it
    /// sends, so a zero page is a short LZ4 block like any other): never [`Packed::Zero`].
    pub fn pack_data(&self, page: &[u8], out: &mut [u8]) -> Packed {
        assert_eq!(page.len(), PAGE_SIZE, "a page is {PAGE_SIZE} bytes");
        let Some(budget) = self.budget() else {
            return Packed::Raw(Skip::LinkFast);
        };
        match lz4_flex::block::compress_into(page, out) {
            Ok(n) if n <= budget => Packed::Compressed(n),
            _ => Packed::Raw(Skip::Aborted),
        }
    }
}

/// The room [`Rule::pack`] needs to write into (LZ4's worst case for a page).
pub const PACKED_ROOM: usize = lz4_flex::block::get_maximum_output_size(PAGE_SIZE);

/// Unpacks a page compressed by [`Rule::pack`] into `out` (`PAGE_SIZE` bytes); anything that
/// does not decompress to exactly a page is refused.
pub fn unpack(compressed: &[u8], out: &mut [u8]) -> Result<(), DecodeError> {
    assert_eq!(out.len(), PAGE_SIZE, "a page is {PAGE_SIZE} bytes");
    match lz4_flex::block::decompress_into(compressed, out) {
        Ok(PAGE_SIZE) => Ok(()),
        Ok(n) => Err(DecodeError::BadValue {
            field: "decompressed page length",
            value: n as u64,
        }),
        Err(_) => Err(DecodeError::BadValue {
            field: "compressed page",
            value: compressed.len() as u64,
        }),
    }
}

/// The codec's cost for one page (compress and decompress, microseconds), measured here on
/// a page half text-like, half random (neither best nor worst case), best of three rounds.
pub fn calibrate() -> f64 {
    let mut page = vec![0u8; PAGE_SIZE];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for (i, b) in page.iter_mut().enumerate() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = if i < PAGE_SIZE / 2 {
            b"the quick brown fox "[i % 20]
        } else {
            x as u8
        };
    }
    let mut packed = vec![0u8; PACKED_ROOM];
    let mut back = vec![0u8; PAGE_SIZE];
    const N: u32 = 200;
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        for _ in 0..N {
            let n = lz4_flex::block::compress_into(&page, &mut packed).expect("room");
            lz4_flex::block::decompress_into(&packed[..n], &mut back).expect("its own output");
        }
        best = best.min(t.elapsed().as_secs_f64() * 1e6 / f64::from(N));
    }
    debug_assert_eq!(back, page);
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// 1 Gbit/s and a codec of 3 µs a page: a page must save 375 bytes.
    const GIGABIT: Rule = Rule {
        link_bytes_per_us: 125.0,
        codec_us: 3.0,
    };

    #[test]
    fn zero_pages_travel_as_a_flag_and_a_fast_link_compresses_nothing_else() {
        let mut out = vec![0u8; PACKED_ROOM];
        let zero = vec![0u8; PAGE_SIZE];
        let sparse: Vec<u8> = (0..PAGE_SIZE).map(|i| u8::from(i % 512 == 0)).collect();
        assert_eq!(GIGABIT.pack(&zero, &mut out), Packed::Zero);
        // Loopback: ~4,000 bytes a microsecond; no saving repays 3 µs.
        let loopback = Rule {
            link_bytes_per_us: 4_000.0,
            ..GIGABIT
        };
        assert_eq!(loopback.budget(), None);
        assert_eq!(loopback.pack(&zero, &mut out), Packed::Zero);
        assert_eq!(
            loopback.pack(&sparse, &mut out),
            Packed::Raw(Skip::LinkFast)
        );
        assert_eq!(GIGABIT.min_saving(), 375);
        assert_eq!(GIGABIT.budget(), Some(PAGE_SIZE - 375));
    }

    /// MIRAGE+'s UptoN (§5.2): a zeroed page whose first N bytes are written with
    /// incompressible values compresses while N is small enough, and the codec gives up past
    /// the budget; what it compresses comes back exactly.
    #[test]
    fn upto_n_compresses_until_the_budget_and_comes_back_whole() {
        let mut rng = 0x1234_5678u64;
        let mut out = vec![0u8; PACKED_ROOM];
        let mut back = vec![0u8; PAGE_SIZE];
        let mut last_compressed = 0;
        for n in (256..=PAGE_SIZE).step_by(256) {
            let mut page = vec![0u8; PAGE_SIZE];
            for b in &mut page[..n] {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                *b = rng as u8;
            }
            match GIGABIT.pack(&page, &mut out) {
                Packed::Compressed(len) => {
                    assert!(len <= GIGABIT.budget().unwrap());
                    unpack(&out[..len], &mut back).unwrap();
                    assert_eq!(back, page);
                    last_compressed = n;
                }
                Packed::Raw(Skip::Aborted) => {}
                other => panic!("{n}: {other:?}"),
            }
        }
        // A quarter of the page random still compresses; all of it does not.
        assert!(
            (PAGE_SIZE / 4..PAGE_SIZE).contains(&last_compressed),
            "{last_compressed}"
        );
    }

    #[test]
    fn the_codec_costs_microseconds_a_page() {
        let us = calibrate();
        eprintln!("LZ4, one page compressed and decompressed: {us:.2} µs");
        assert!(us > 0.0 && us < 1_000.0, "{us} µs a page");
    }

    proptest! {
        /// Whatever the page: packed and unpacked it is the same page; and whatever bytes
        /// arrive as a compressed page, they are a page or an error, never a panic.
        #[test]
        fn packing_round_trips_and_garbage_is_refused(
            seed in any::<u64>(),
            zeros in 0usize..PAGE_SIZE,
            garbage in proptest::collection::vec(any::<u8>(), 0..600),
        ) {
            let mut x = seed | 1;
            let page: Vec<u8> = (0..PAGE_SIZE)
                .map(|i| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    if i < zeros { 0 } else { (x % 7) as u8 }
                })
                .collect();
            let mut out = vec![0u8; PACKED_ROOM];
            let mut back = vec![0u8; PAGE_SIZE];
            if let Packed::Compressed(n) = GIGABIT.pack(&page, &mut out) {
                unpack(&out[..n], &mut back).unwrap();
                prop_assert_eq!(&back, &page);
            }
            let _ = unpack(&garbage, &mut back);
        }
    }
}
