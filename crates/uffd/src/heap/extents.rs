//! The page ranges of a heap's region: first fit over two ordered maps. Large blocks and the
//! spans of small ones are carved from here. No I/O: the heap around it releases what `free`
//! returns.

use std::collections::BTreeMap;

/// Free and used page ranges of a heap, in pages from the region's start.
#[derive(Debug)]
pub(crate) struct Extents {
    /// Free ranges: start → length.
    free: BTreeMap<usize, usize>,
    /// Allocations: start → length.
    used: BTreeMap<usize, usize>,
}

impl Extents {
    pub(crate) fn new(pages: usize) -> Self {
        Self {
            free: BTreeMap::from([(0, pages)]),
            used: BTreeMap::new(),
        }
    }

    /// First fit of `pages` pages starting at a multiple of `align` pages.
    pub(crate) fn alloc(&mut self, pages: usize, align: usize) -> Option<usize> {
        let (start, len, at) = self.free.iter().find_map(|(&start, &len)| {
            let at = start.next_multiple_of(align);
            (at + pages <= start + len).then_some((start, len, at))
        })?;
        self.free.remove(&start);
        if at > start {
            self.free.insert(start, at - start);
        }
        if at + pages < start + len {
            self.free.insert(at + pages, start + len - at - pages);
        }
        self.used.insert(at, pages);
        Some(at)
    }

    /// Frees the allocation starting at `start`; returns its length, or `None` if no
    /// allocation starts there.
    pub(crate) fn free(&mut self, start: usize) -> Option<usize> {
        let pages = self.used.remove(&start)?;
        let (mut s, mut l) = (start, pages);
        if let Some((&ps, &pl)) = self.free.range(..start).next_back() {
            if ps + pl == start {
                self.free.remove(&ps);
                (s, l) = (ps, pl + l);
            }
        }
        if let Some(&nl) = self.free.get(&(start + pages)) {
            self.free.remove(&(start + pages));
            l += nl;
        }
        self.free.insert(s, l);
        Some(pages)
    }

    pub(crate) fn len_of(&self, start: usize) -> Option<usize> {
        self.used.get(&start).copied()
    }

    pub(crate) fn free_ranges(&self) -> usize {
        self.free.len()
    }

    pub(crate) fn largest_free(&self) -> usize {
        self.free.values().copied().max().unwrap_or(0)
    }

    pub(crate) fn used_pages(&self) -> usize {
        self.used.values().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::Extents;

    #[test]
    fn first_fit_alignment_and_coalescing() {
        let mut e = Extents::new(100);
        assert_eq!(e.alloc(10, 1), Some(0));
        assert_eq!(e.alloc(10, 16), Some(16));
        assert_eq!(e.alloc(6, 1), Some(10)); // the gap left by the alignment
        assert_eq!(e.alloc(80, 1), None);
        assert_eq!(e.free(10), Some(6));
        assert_eq!(e.free(10), None, "double free");
        assert_eq!(e.free(3), None, "not an allocation's start");
        assert_eq!(e.free(0), Some(10));
        assert_eq!(e.free(16), Some(10));
        // Everything coalesced back into one range.
        assert_eq!(e.alloc(100, 1), Some(0));
        assert_eq!(e.used_pages(), 100);
    }
}
