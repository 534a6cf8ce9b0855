//! Small blocks on a region: size classes in spans, with every bit of bookkeeping outside the
//! region. No I/O; [`super::RegionHeap`] gives it spans and gives back the empty ones.
//!
//! `netram run` puts the whole heap of a program on its region, so that `--local-mem` bounds
//! the memory of programs made of small objects (an in-memory database, an interpreter) and
//! not only of their large arrays (Anemone §2.1: every page the program uses may live remote).
//! A span of [`SPAN`] bytes is cut into blocks of one size class; a bitmap per span, kept in
//! the C library's memory, says which blocks are taken.
//!
//! Why written here rather than taken from a crate (measured, `crates/bench/examples/heaps.rs`,
//! figures in `heap`'s opening comment): the allocators that manage memory they are
//! given (talc, rlsf's TLSF, linked lists) keep their free lists and boundary tags inside the
//! blocks. On a region, where most pages of a large heap are remote, that makes `free` of a cold
//! block fetch its page over the network only to write a link into it (and coalescing reads
//! the neighbours' tags, more pages); and they never say when a range of pages became free, so
//! freed memory would stay resident or be written back to the servers as garbage. Here `malloc`
//! and `free` touch no byte of the region, and a span whose last block is freed is given back
//! whole (its pages dropped locally, deleted on their servers). The C library's allocator is no
//! better a fit: its main heap grows with `brk`, outside the region, and it keeps its headers in
//! the blocks too.

use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

/// Span ids are small dense integers: a multiplication spreads them over the table's bits, at
/// a fraction of SipHash's cost on every `malloc` and `free`.
#[derive(Debug, Default)]
struct SpanIdHasher(u64);

impl Hasher for SpanIdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u32(&mut self, id: u32) {
        self.0 = u64::from(id).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// The size of a span: 64 pages. Large enough that the bitmap (at most 2 KiB for 16-byte
/// blocks) is small beside it, small enough that a class used a little costs little.
pub(crate) const SPAN: usize = 256 << 10;

/// The largest block served from spans (at least 8 blocks a span); larger ones are whole
/// pages (`super::Extents`).
pub(crate) const MAX_SMALL: usize = 32 << 10;

/// The alignment of every block: what `malloc` guarantees on 64-bit Linux.
pub(crate) const MIN_ALIGN: usize = 16;

/// Size classes: every 16 bytes up to 128, then four a doubling up to [`MAX_SMALL`] (at most
/// a fifth of a block wasted past 128 bytes).
pub(crate) fn class_size(class: u8) -> usize {
    let c = usize::from(class);
    if c < 8 {
        return (c + 1) * 16;
    }
    // Class 8 is 160: 128 + 32; each group of four doubles the step.
    let group = (c - 8) / 4; // 0 → 129..=256, 1 → 257..=512, ...
    let step = 32 << group;
    (128 << group) + ((c - 8) % 4 + 1) * step
}

/// How many classes there are.
pub(crate) const CLASSES: usize = 8 + 4 * 8; // up to 128 << 8 = 32 KiB

/// The class for a block of `size` bytes aligned to `align`, or `None` if it is not small.
/// An alignment above 16 takes the power-of-two class at least as large: its blocks sit at
/// multiples of their size within a span, itself aligned to [`SPAN`].
pub(crate) fn class_of(size: usize, align: usize) -> Option<u8> {
    let size = size.max(1);
    let size = if align > MIN_ALIGN {
        size.max(align).checked_next_power_of_two()?
    } else {
        size
    };
    if size > MAX_SMALL {
        return None;
    }
    if size <= 128 {
        return Some((size.div_ceil(16) - 1) as u8);
    }
    // size in (128 << g, 256 << g]: g = floor(log2(size - 1)) - 7.
    let g = (usize::BITS - 1 - (size - 1).leading_zeros()) as usize - 7;
    let step = 32usize << g;
    let within = (size - (128 << g)).div_ceil(step); // 1..=4
    Some((8 + 4 * g + within - 1) as u8)
}

/// One span's blocks.
#[derive(Debug)]
struct Span {
    class: u8,
    /// Blocks taken.
    live: u32,
    /// Blocks in the span.
    blocks: u32,
    /// Blocks at and past this one were never handed out since the span was given: they read
    /// as zeros (the span's pages were released before it came here).
    fresh_from: u32,
    /// No free block before this word of `taken`.
    hint: u32,
    /// One bit a block, set when taken; the bits past the last block are set.
    taken: Box<[u64]>,
}

/// A block handed out: its span, its byte offset in the span, its size (the class's), and
/// whether it reads as zeros.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Block {
    pub span: u32,
    pub offset: usize,
    pub size: usize,
    pub zeroed: bool,
}

/// What a `free` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Freed {
    /// The block's size (its class's).
    pub size: usize,
    /// The span is empty and was removed: the caller gives its pages back.
    pub retired: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SlabError {
    #[error("not the start of a block")]
    NotABlock,
    #[error("a block that is not allocated (freed twice?)")]
    NotAllocated,
}

/// The spans of one shard of a heap (a group of threads allocates from one shard; any thread
/// frees into the shard that owns the span).
#[derive(Debug)]
pub(crate) struct Slabs {
    spans: HashMap<u32, Span, BuildHasherDefault<SpanIdHasher>>,
    /// Per class, the spans with a free block. The lowest first: live blocks pack towards the
    /// start of the region, onto fewer pages.
    partial: Vec<BTreeSet<u32>>,
}

impl Default for Slabs {
    fn default() -> Self {
        Self {
            spans: HashMap::default(),
            partial: vec![BTreeSet::new(); CLASSES],
        }
    }
}

impl Slabs {
    /// A free block of `class`, or `None`: the caller adds a span ([`Slabs::add_span`]).
    pub(crate) fn alloc(&mut self, class: u8) -> Option<Block> {
        let set = &mut self.partial[usize::from(class)];
        let &id = set.first()?;
        let span = self.spans.get_mut(&id).expect("partial spans are known");
        let start = span.hint as usize;
        let (w, word) = span.taken[start..]
            .iter()
            .enumerate()
            .find(|(_, w)| **w != u64::MAX)
            .map(|(i, w)| (start + i, *w))
            .expect("a partial span has a free block");
        let bit = word.trailing_ones();
        span.taken[w] |= 1 << bit;
        span.hint = w as u32;
        span.live += 1;
        let index = w as u32 * 64 + bit;
        let zeroed = index >= span.fresh_from;
        if zeroed {
            span.fresh_from = index + 1;
        }
        if span.live == span.blocks {
            set.remove(&id);
        }
        let size = class_size(span.class);
        Some(Block {
            span: id,
            offset: index as usize * size,
            size,
            zeroed,
        })
    }

    /// Span `id` (fresh: reading as zeros) now serves `class`.
    pub(crate) fn add_span(&mut self, id: u32, class: u8) {
        let blocks = (SPAN / class_size(class)) as u32;
        let words = blocks.div_ceil(64) as usize;
        let mut taken = vec![0u64; words].into_boxed_slice();
        if !blocks.is_multiple_of(64) {
            taken[words - 1] = !0u64 << (blocks % 64);
        }
        let old = self.spans.insert(
            id,
            Span {
                class,
                live: 0,
                blocks,
                fresh_from: 0,
                hint: 0,
                taken,
            },
        );
        debug_assert!(old.is_none(), "span {id} added twice");
        self.partial[usize::from(class)].insert(id);
    }

    /// The size of the block at `offset` in span `id`, if one is allocated there.
    pub(crate) fn size_of(&self, id: u32, offset: usize) -> Option<usize> {
        let span = self.spans.get(&id)?;
        let size = class_size(span.class);
        let index = offset / size;
        (offset.is_multiple_of(size) && span.is_taken(index)).then_some(size)
    }

    /// Frees the block at `offset` in span `id`. An empty span is retired unless it is the
    /// only one of its class with room (kept, so that a program allocating and freeing one
    /// block at a time does not take and give back a span each time).
    pub(crate) fn free(&mut self, id: u32, offset: usize) -> Result<Freed, SlabError> {
        let span = self.spans.get_mut(&id).ok_or(SlabError::NotAllocated)?;
        let size = class_size(span.class);
        if !offset.is_multiple_of(size) {
            return Err(SlabError::NotABlock);
        }
        let index = offset / size;
        if index >= span.blocks as usize || !span.is_taken(index) {
            return Err(SlabError::NotAllocated);
        }
        let was_full = span.live == span.blocks;
        span.taken[index / 64] &= !(1 << (index % 64));
        span.hint = span.hint.min((index / 64) as u32);
        span.live -= 1;
        let set = &mut self.partial[usize::from(span.class)];
        if was_full {
            set.insert(id);
        }
        let retired = span.live == 0 && set.len() > 1;
        if retired {
            set.remove(&id);
            self.spans.remove(&id);
        }
        Ok(Freed { size, retired })
    }

    /// Spans held (for tests and counters).
    #[cfg(test)]
    pub(crate) fn spans(&self) -> usize {
        self.spans.len()
    }
}

impl Span {
    fn is_taken(&self, index: usize) -> bool {
        index < self.blocks as usize && self.taken[index / 64] & (1 << (index % 64)) != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn classes_cover_every_size_with_little_waste() {
        let mut last = 0;
        for c in 0..CLASSES as u8 {
            let s = class_size(c);
            assert!(s > last, "classes grow");
            assert_eq!(s % MIN_ALIGN, 0);
            last = s;
        }
        assert_eq!(last, MAX_SMALL);
        for size in 1..=MAX_SMALL {
            let c = class_of(size, 8).expect("small");
            let s = class_size(c);
            assert!(s >= size, "{size} fits class {c} of {s}");
            if c > 0 {
                assert!(
                    class_size(c - 1) < size,
                    "{size}: the smallest class that fits"
                );
            }
            assert!(
                size <= 128 || (s - size) * 5 <= s,
                "{size} in {s}: a fifth wasted at most"
            );
        }
        assert_eq!(class_of(MAX_SMALL + 1, 8), None);
        assert_eq!(class_of(0, 1), Some(0));
    }

    #[test]
    fn aligned_classes_place_blocks_on_their_alignment() {
        for align in [32usize, 64, 256, 4096, 16384] {
            for size in [1usize, 17, 100, 3000, 20000] {
                let Some(c) = class_of(size, align) else {
                    assert!(size.max(align).next_power_of_two() > MAX_SMALL);
                    continue;
                };
                let s = class_size(c);
                assert!(s >= size && s.is_multiple_of(align), "{size}@{align} → {s}");
                assert!(SPAN.is_multiple_of(s), "whole blocks at multiples of {s}");
            }
        }
        assert_eq!(class_of(8, 65536), None);
    }

    #[test]
    fn blocks_are_distinct_reused_and_spans_retired() {
        let mut s = Slabs::default();
        let class = class_of(48, 16).unwrap();
        assert_eq!(s.alloc(class), None, "no span yet");
        s.add_span(0, class);
        let per_span = SPAN / 48;
        let mut seen = HashSet::new();
        let mut blocks = Vec::new();
        for i in 0..per_span {
            let b = s.alloc(class).unwrap();
            assert_eq!(b.size, 48);
            assert!(b.zeroed, "first use of every block");
            assert!(b.offset + 48 <= SPAN);
            assert_eq!(b.offset, i * 48, "packed from the start");
            assert!(seen.insert(b.offset));
            blocks.push(b);
        }
        assert_eq!(s.alloc(class), None, "full");
        s.add_span(1, class);
        let other = s.alloc(class).unwrap();
        assert_eq!((other.span, other.offset), (1, 0));
        // A freed block is the next one handed out, and it is not zeroed any more.
        assert_eq!(
            s.free(0, 480),
            Ok(Freed {
                size: 48,
                retired: false
            })
        );
        assert_eq!(s.size_of(0, 480), None);
        let again = s.alloc(class).unwrap();
        assert_eq!((again.span, again.offset, again.zeroed), (0, 480, false));
        assert_eq!(s.size_of(0, 480), Some(48));
        // Mistakes are refused, not corrupting.
        assert_eq!(s.free(0, 481), Err(SlabError::NotABlock));
        assert_eq!(s.free(1, 48), Err(SlabError::NotAllocated));
        assert_eq!(s.free(7, 0), Err(SlabError::NotAllocated));
        // Emptying span 1 while span 0 has room: retired. Emptying span 0 then: kept, as the
        // last span of its class.
        assert_eq!(
            s.free(1, 0),
            Ok(Freed {
                size: 48,
                retired: false
            }),
            "0 is full"
        );
        s.free(0, 0).unwrap();
        assert!(s.free(1, 0).is_err(), "freed twice");
        assert_eq!(s.spans(), 2);
        let b = s.alloc(class).unwrap();
        assert_eq!((b.span, b.offset), (0, 0), "the lowest span first");
        s.free(0, 0).unwrap();
        for b in &blocks[1..] {
            if b.offset != 0 {
                s.free(0, b.offset).unwrap();
            }
        }
        // Span 0 emptied while span 1 (empty, kept) has room: span 0 is given back.
        assert_eq!(s.spans(), 1);
        assert_eq!(s.alloc(class).map(|b| b.span), Some(1));
    }

    #[test]
    fn an_empty_span_is_given_back_when_another_has_room() {
        let mut s = Slabs::default();
        let class = class_of(MAX_SMALL, 16).unwrap();
        s.add_span(3, class);
        let a: Vec<Block> = (0..8).map(|_| s.alloc(class).unwrap()).collect();
        s.add_span(9, class);
        let b = s.alloc(class).unwrap();
        assert_eq!(b.span, 9);
        for x in &a {
            let f = s.free(3, x.offset).unwrap();
            assert_eq!(
                f.retired,
                x.offset == a[7].offset,
                "retired with its last block"
            );
        }
        assert_eq!(s.spans(), 1);
        assert!(!s.free(9, 0).unwrap().retired, "the last span is kept");
    }

    #[test]
    fn random_churn_keeps_the_bookkeeping_exact() {
        // A model check: every live block distinct and known, against a plain set.
        let mut s = Slabs::default();
        let mut live: Vec<(u32, usize, u8)> = Vec::new();
        let mut next_span = 0;
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if !x.is_multiple_of(3) || live.is_empty() {
                let class = (x >> 8) as u8 % 12;
                let b = match s.alloc(class) {
                    Some(b) => b,
                    None => {
                        s.add_span(next_span, class);
                        next_span += 1;
                        s.alloc(class).unwrap()
                    }
                };
                live.push((b.span, b.offset, class));
            } else {
                let i = (x >> 20) as usize % live.len();
                let (span, off, class) = live.swap_remove(i);
                assert_eq!(s.free(span, off).unwrap().size, class_size(class));
            }
        }
        let set: HashSet<_> = live.iter().map(|&(s, o, _)| (s, o)).collect();
        assert_eq!(set.len(), live.len(), "no block handed out twice");
        for &(span, off, class) in &live {
            assert_eq!(s.size_of(span, off), Some(class_size(class)));
        }
    }
}
