//! Which pages to fetch with a faulting one: a trend detector in the spirit of Leap (Maruf and
//! Chowdhury, ATC 2020) for sequential and strided access, and the neighbours of the faulting
//! page (the kernel's swap readahead, `swap_vma_readahead`) when there is no trend.
//!
//! The detector keeps the last [`HISTORY`] faulting pages and looks for a majority among the
//! strides between consecutive ones (Boyer-Moore voting: linear, no allocation). With a
//! majority stride `s` it proposes the next pages along it from the faulting page, as many as
//! the stride depth ([`Mode::Stride`]). Without one it proposes the other pages of the aligned
//! cluster around the faulting page, as many as the cluster depth ([`Mode::Cluster`]): a
//! program that scans several arrays at once (a merge sort's runs), or whose objects span
//! neighbouring pages, faults in no order a stride vote sees, yet uses the pages next to each
//! fault. The pages proposed travel with the faulting page in one request, so a good guess
//! saves a round trip and a bad one costs bytes and a page of local memory.
//!
//! Each depth adapts to how its proposals fare: it doubles (up to its maximum) when a page it
//! proposed is used and halves when one is evicted unused; the cluster depth can fall to 1
//! (no readahead: a program that touches its pages at random), and it is then tried again
//! after [`RETRY_AFTER`] faults. Pure: the caller fetches, and reports hits and waste.

use std::collections::VecDeque;

/// Faults remembered for the vote.
pub const HISTORY: usize = 8;

/// The largest cluster (pages, a power of two): the kernel's default swap readahead
/// (`vm.page-cluster` = 3).
pub const MAX_CLUSTER: usize = 8;

/// Faults after which a cluster depth fallen to 1 is raised to 2 again: a program's phases
/// change (a random build, then a scan), and with no readahead there is no feedback.
pub const RETRY_AFTER: u32 = 256;

/// Which rule proposed a page; each has its own depth.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Along the majority stride.
    Stride,
    /// The neighbours of the faulting page.
    Cluster,
}

#[derive(Debug, Clone)]
pub struct Prefetcher {
    history: VecDeque<u64>,
    depth: usize,
    max_depth: usize,
    cluster: usize,
    max_cluster: usize,
    /// Faults since the cluster depth fell to 1.
    idle: u32,
}

impl Prefetcher {
    /// `max_depth`: the most pages proposed along a stride at one fault; `max_cluster`: the
    /// largest cluster around a fault (rounded down to a power of two; 0 or 1: none). Both 0
    /// disable prefetching.
    pub fn new(max_depth: usize, max_cluster: usize) -> Self {
        let max_cluster = match max_cluster {
            0 => 1,
            n => 1 << n.ilog2(),
        };
        Self {
            history: VecDeque::with_capacity(HISTORY),
            depth: max_depth.min(2),
            max_depth,
            cluster: max_cluster.min(4),
            max_cluster,
            idle: 0,
        }
    }

    /// How many pages ahead a stride is followed now.
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// The size of the cluster read around a fault without a trend now (1: none).
    pub fn cluster(&self) -> usize {
        self.cluster
    }

    /// Records a fault on `page` and returns the pages to fetch with it, in the order they
    /// will probably be needed, and the rule that chose them; those at or above `pages` are
    /// left out.
    pub fn on_fault(&mut self, page: u64, pages: u64) -> (Vec<u64>, Mode) {
        if self.history.len() == HISTORY {
            self.history.pop_front();
        }
        self.history.push_back(page);
        if let Some(stride) = self.majority_stride() {
            let ahead = (1..=self.depth as i64)
                .map_while(|k| page.checked_add_signed(stride.checked_mul(k)?))
                .filter(|&p| p < pages)
                .collect();
            return (ahead, Mode::Stride);
        }
        if self.cluster == 1 && self.max_cluster > 1 {
            self.idle += 1;
            if self.idle >= RETRY_AFTER {
                self.idle = 0;
                self.cluster = 2;
            }
        }
        // The aligned cluster, the pages after the fault first: programs walk memory upwards
        // more often than down.
        let n = self.cluster as u64;
        let start = page - page % n;
        let after = (page + 1..start + n).filter(|&p| p < pages);
        (after.chain(start..page).collect(), Mode::Cluster)
    }

    /// A page proposed by `mode` was used before it was evicted.
    pub fn hit(&mut self, mode: Mode) {
        match mode {
            Mode::Stride => self.depth = (self.depth * 2).max(1).min(self.max_depth),
            Mode::Cluster => self.cluster = (self.cluster * 2).min(self.max_cluster),
        }
    }

    /// A page proposed by `mode` was evicted unused.
    pub fn wasted(&mut self, mode: Mode) {
        match mode {
            Mode::Stride => self.depth = (self.depth / 2).max(1).min(self.max_depth),
            Mode::Cluster => {
                self.cluster = (self.cluster / 2).max(1);
                self.idle = 0;
            }
        }
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

    fn ahead(p: &mut Prefetcher, page: u64, pages: u64) -> Vec<u64> {
        let (ahead, mode) = p.on_fault(page, pages);
        assert_eq!(mode, Mode::Stride, "page {page}");
        ahead
    }

    #[test]
    fn sequential_and_strided_access_is_followed() {
        let mut p = Prefetcher::new(8, 0);
        assert_eq!(p.on_fault(10, 1000), (vec![], Mode::Cluster), "no trend");
        assert_eq!(
            p.on_fault(11, 1000).1,
            Mode::Cluster,
            "one stride is no trend"
        );
        assert_eq!(ahead(&mut p, 12, 1000), vec![13, 14]);
        p.hit(Mode::Stride);
        assert_eq!(ahead(&mut p, 13, 1000), vec![14, 15, 16, 17]);
        // A backward stride of 3.
        let mut p = Prefetcher::new(4, 0);
        for page in [100, 97, 94] {
            p.on_fault(page, 1000);
        }
        assert_eq!(ahead(&mut p, 91, 1000), vec![88, 85]);
    }

    #[test]
    fn without_a_trend_the_aligned_cluster_is_proposed_and_edges_are_respected() {
        let mut p = Prefetcher::new(8, 8);
        assert_eq!(p.cluster(), 4);
        assert_eq!(p.on_fault(5, 1000), (vec![6, 7, 4], Mode::Cluster));
        assert_eq!(p.on_fault(900, 1000), (vec![901, 902, 903], Mode::Cluster));
        p.hit(Mode::Cluster);
        assert_eq!(p.cluster(), 8);
        assert_eq!(
            p.on_fault(17, 1000),
            (vec![18, 19, 20, 21, 22, 23, 16], Mode::Cluster)
        );
        // The region's last pages: nothing past its end.
        assert_eq!(
            p.on_fault(997, 998),
            (vec![992, 993, 994, 995, 996], Mode::Cluster)
        );
        let mut p = Prefetcher::new(8, 8);
        for page in [997, 998] {
            p.on_fault(page, 1000);
        }
        assert_eq!(ahead(&mut p, 999, 1000), Vec::<u64>::new());
        let mut p = Prefetcher::new(8, 8);
        for page in [2, 1] {
            p.on_fault(page, 1000);
        }
        assert_eq!(ahead(&mut p, 0, 1000), Vec::<u64>::new());
    }

    #[test]
    fn depths_follow_hits_and_waste_each_for_its_rule() {
        let mut p = Prefetcher::new(16, 8);
        assert_eq!((p.depth(), p.cluster()), (2, 4));
        for _ in 0..10 {
            p.hit(Mode::Stride);
        }
        assert_eq!((p.depth(), p.cluster()), (16, 4));
        for _ in 0..10 {
            p.wasted(Mode::Stride);
            p.hit(Mode::Cluster);
        }
        assert_eq!((p.depth(), p.cluster()), (1, 8));
        for _ in 0..10 {
            p.wasted(Mode::Cluster);
        }
        assert_eq!(p.cluster(), 1);
        let mut off = Prefetcher::new(0, 0);
        off.hit(Mode::Stride);
        off.hit(Mode::Cluster);
        for page in 0..5 {
            assert!(off.on_fault(page, 100).0.is_empty());
        }
    }

    #[test]
    fn random_access_turns_readahead_off_and_tries_it_again_later() {
        let mut p = Prefetcher::new(8, 8);
        for _ in 0..3 {
            p.wasted(Mode::Cluster);
        }
        let mut rng = 12345u64;
        for _ in 0..RETRY_AFTER - 1 {
            rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let (ahead, _) = p.on_fault((rng >> 33) % 100_000, 100_000);
            assert!(ahead.is_empty());
        }
        assert_eq!(p.on_fault(64, 100_000), (vec![65], Mode::Cluster));
    }

    #[test]
    fn a_trend_survives_a_stray_fault() {
        let mut p = Prefetcher::new(2, 8);
        for page in [0, 1, 2, 3, 500, 4, 5] {
            p.on_fault(page, 1000);
        }
        assert_eq!(ahead(&mut p, 6, 1000), vec![7, 8]);
    }
}
