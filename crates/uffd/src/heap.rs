//! Allocations carved out of one region: what `netram_alloc`, the global allocator adapter and
//! `netram run`'s `malloc` hand out.
//!
//! Every allocation is whole pages, page-aligned (or more), so that freeing one gives its pages
//! back with [`Region::release`] (local memory dropped, remote copies deleted) without touching
//! its neighbours. Only large allocations come here (small ones stay with the C library), so
//! the bookkeeping is two ordered maps and first fit: an allocation is rare next to the page
//! faults it causes. Written by hand because it must give back exact page ranges to the
//! region; general-purpose allocators keep freed memory to themselves.

use crate::Region;
use netram_pager::{Disk, Transport};
use netram_proto::PAGE_SIZE;
use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::Mutex;

/// Free and used page ranges of a heap, in pages from the region's start. No I/O: the heap
/// around it releases what `free` returns.
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

    pub(crate) fn used_pages(&self) -> usize {
        self.used.values().sum()
    }
}

/// A region handing out page-granular allocations.
#[derive(Debug)]
pub struct RegionHeap<T: Transport, D: Disk> {
    region: Region<T, D>,
    extents: Mutex<Extents>,
}

#[derive(Debug, thiserror::Error)]
pub enum FreeError {
    #[error("{0:#x} was not allocated from this heap")]
    NotAllocated(usize),
    #[error(transparent)]
    Release(#[from] crate::RegionError),
}

impl<T: Transport, D: Disk> RegionHeap<T, D> {
    pub fn new(region: Region<T, D>) -> Self {
        let pages = region.len() / PAGE_SIZE;
        Self {
            region,
            extents: Mutex::new(Extents::new(pages)),
        }
    }

    pub fn region(&self) -> &Region<T, D> {
        &self.region
    }

    fn extents(&self) -> std::sync::MutexGuard<'_, Extents> {
        self.extents.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `size` bytes (rounded up to whole pages) aligned to `align` (a power of two; at least a
    /// page), reading as zeros; `None` when the region has no such free range.
    pub fn alloc(&self, size: usize, align: usize) -> Option<NonNull<u8>> {
        let pages = size.max(1).div_ceil(PAGE_SIZE);
        let align = align.max(PAGE_SIZE) / PAGE_SIZE;
        let start = self.extents().alloc(pages, align)?;
        // Released pages read as zeros and never-touched ones are zero-filled: nothing to do.
        NonNull::new(self.region.as_ptr().wrapping_add(start * PAGE_SIZE))
    }

    /// Whether `ptr` points into this heap's region.
    pub fn contains(&self, ptr: *const u8) -> bool {
        let base = self.region.as_ptr() as usize;
        (base..base + self.region.len()).contains(&(ptr as usize))
    }

    fn start_of(&self, ptr: *const u8) -> Option<usize> {
        let off = (ptr as usize).checked_sub(self.region.as_ptr() as usize)?;
        (off % PAGE_SIZE == 0 && off < self.region.len()).then_some(off / PAGE_SIZE)
    }

    /// The usable size of the allocation at `ptr`.
    pub fn size_of(&self, ptr: *const u8) -> Option<usize> {
        let start = self.start_of(ptr)?;
        self.extents().len_of(start).map(|p| p * PAGE_SIZE)
    }

    /// Frees the allocation at `ptr`: its pages are released (see [`Region::release`]) before
    /// they can be handed out again.
    pub fn free(&self, ptr: *const u8) -> Result<usize, FreeError> {
        let start = self
            .start_of(ptr)
            .ok_or(FreeError::NotAllocated(ptr as usize))?;
        let mut ext = self.extents();
        let pages = ext
            .len_of(start)
            .ok_or(FreeError::NotAllocated(ptr as usize))?;
        // Released under the heap's lock: the range cannot be handed out again meanwhile.
        self.region.release(start * PAGE_SIZE, pages * PAGE_SIZE)?;
        ext.free(start);
        Ok(pages * PAGE_SIZE)
    }

    /// Bytes allocated now.
    pub fn allocated(&self) -> usize {
        self.extents().used_pages() * PAGE_SIZE
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
