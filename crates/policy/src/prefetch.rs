//! Which pages to fetch before they fault: a trend detector in the spirit of Leap (Maruf and
//! Chowdhury, ATC 2020), for sequential and strided access.
//!
//! The detector keeps the last [`HISTORY`] faulting pages and looks for a majority among the
//! strides between consecutive ones (Boyer-Moore voting: linear, no allocation). With a
//! majority stride `s` it proposes the next pages along it from the faulting page, as many as
//! the current depth; without one it proposes nothing. The depth adapts to how the proposals
//! fare: it doubles (up to a maximum) when a prefetched page is used and halves when a
//! prefetched page is evicted unused. Pure: the caller fetches, and reports hits and waste.

use std::collections::VecDeque;

/// Faults remembered for the vote.
pub const HISTORY: usize = 8;

#[derive(Debug, Clone)]
pub struct Prefetcher {
    history: VecDeque<u64>,
    depth: usize,
    max_depth: usize,
}

impl Prefetcher {
    /// `max_depth`: the most pages proposed at one fault (0 disables prefetching).
    pub fn new(max_depth: usize) -> Self {
        Self {
            history: VecDeque::with_capacity(HISTORY),
            depth: max_depth.min(2),
            max_depth,
        }
    }

    pub fn depth(&self) -> usize {
        self.depth
    }

    /// Records a fault on `page` and returns the pages to fetch ahead, in the order they will
    /// probably be needed; those below 0 or at or above `pages` are left out.
    pub fn on_fault(&mut self, page: u64, pages: u64) -> Vec<u64> {
        if self.history.len() == HISTORY {
            self.history.pop_front();
        }
        self.history.push_back(page);
        let Some(stride) = self.majority_stride() else {
            return Vec::new();
        };
        (1..=self.depth as i64)
            .map_while(|k| page.checked_add_signed(stride.checked_mul(k)?))
            .filter(|&p| p < pages)
            .collect()
    }

    /// A prefetched page was used before it was evicted.
    pub fn hit(&mut self) {
        self.depth = (self.depth * 2).max(1).min(self.max_depth);
    }

    /// A prefetched page was evicted unused.
    pub fn wasted(&mut self) {
        self.depth = (self.depth / 2).max(1).min(self.max_depth);
    }

    /// The stride that more than half of the recent strides share, if any (and not 0).
    fn majority_stride(&self) -> Option<i64> {
        let strides = || {
            self.history
                .iter()
                .zip(self.history.iter().skip(1))
                .map(|(&a, &b)| b as i64 - a as i64)
        };
        let n = strides().count();
        if n < 2 {
            return None;
        }
        let (mut candidate, mut votes) = (0i64, 0usize);
        for s in strides() {
            if votes == 0 {
                candidate = s;
                votes = 1;
            } else if s == candidate {
                votes += 1;
            } else {
                votes -= 1;
            }
        }
        let count = strides().filter(|&s| s == candidate).count();
        (candidate != 0 && count * 2 > n).then_some(candidate)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequential_and_strided_access_is_followed() {
        let mut p = Prefetcher::new(8);
        assert!(p.on_fault(10, 1000).is_empty(), "one fault is no trend");
        assert!(p.on_fault(11, 1000).is_empty(), "one stride is no trend");
        assert_eq!(p.on_fault(12, 1000), vec![13, 14]);
        p.hit();
        assert_eq!(p.on_fault(13, 1000), vec![14, 15, 16, 17]);
        // A backward stride of 3.
        let mut p = Prefetcher::new(4);
        for page in [100, 97, 94] {
            p.on_fault(page, 1000);
        }
        assert_eq!(p.on_fault(91, 1000), vec![88, 85]);
    }

    #[test]
    fn random_access_proposes_nothing_and_edges_are_respected() {
        let mut p = Prefetcher::new(8);
        for page in [5, 900, 17, 333, 2, 640, 71, 128] {
            assert!(p.on_fault(page, 1000).is_empty(), "page {page}");
        }
        let mut p = Prefetcher::new(8);
        for page in [997, 998] {
            p.on_fault(page, 1000);
        }
        assert_eq!(p.on_fault(999, 1000), Vec::<u64>::new());
        let mut p = Prefetcher::new(8);
        for page in [2, 1] {
            p.on_fault(page, 1000);
        }
        assert_eq!(p.on_fault(0, 1000), Vec::<u64>::new());
    }

    #[test]
    fn depth_follows_hits_and_waste() {
        let mut p = Prefetcher::new(16);
        assert_eq!(p.depth(), 2);
        for _ in 0..10 {
            p.hit();
        }
        assert_eq!(p.depth(), 16);
        for _ in 0..10 {
            p.wasted();
        }
        assert_eq!(p.depth(), 1);
        let mut off = Prefetcher::new(0);
        off.hit();
        for page in 0..5 {
            assert!(off.on_fault(page, 100).is_empty());
        }
    }

    #[test]
    fn a_trend_survives_a_stray_fault() {
        let mut p = Prefetcher::new(2);
        for page in [0, 1, 2, 3, 500, 4, 5] {
            p.on_fault(page, 1000);
        }
        assert_eq!(p.on_fault(6, 1000), vec![7, 8]);
    }
}
