//! Page ages, summarised (GMS §3.2, §5.2): what every node sends the epoch's initiator.
//!
//! A summary is a histogram of the node's page ages in logarithmic buckets (three a doubling,
//! ~26 % wide), plus its free frames, which count as older than any page: a frame nobody uses
//! is the first a global page should take. A histogram is a fixed size whatever the node
//! holds (GMS scanned every page and sent per-node counts too, Table 5), so the initiator's
//! work and the traffic grow with the number of nodes, not of pages.

use super::NodeId;

/// Buckets a summary has: three a doubling from 1 ms, so the last one starts at 2^31.7 ms
/// (~40 days); anything older shares it.
pub const BUCKETS: usize = 96;

/// The bucket an age (in milliseconds, already boosted if global) falls in: 0 for under 1 ms,
/// then ⌊3·log₂ age⌋ + 1.
pub fn bucket(age_ms: u64) -> usize {
    if age_ms == 0 {
        return 0;
    }
    // Integer log₂ and the position within the doubling by comparing against 2^(1/3) and
    // 2^(2/3) of its lower end, so that the same age always lands in the same bucket on
    // every machine (no floating point).
    let l = 63 - age_ms.leading_zeros() as usize;
    if 3 * l + 1 > BUCKETS - 1 {
        return BUCKETS - 1;
    }
    let low = 1u128 << l;
    let x = u128::from(age_ms);
    // x³ ≥ 2·low³ ⇔ x ≥ 2^(1/3)·low; x³ ≥ 4·low³ ⇔ x ≥ 2^(2/3)·low.
    let x3 = x * x * x;
    let l3 = low * low * low;
    let third = if x3 >= 4 * l3 {
        2
    } else if x3 >= 2 * l3 {
        1
    } else {
        0
    };
    (3 * l + third + 1).min(BUCKETS - 1)
}

/// The youngest age in a bucket: every age in bucket `b` is at least this.
pub fn bucket_floor_ms(b: usize) -> u64 {
    if b == 0 {
        return 0;
    }
    let (l, third) = ((b - 1) / 3, (b - 1) % 3);
    let low = 1u64 << l;
    // The smallest x in [low, 2·low] with x³ ≥ 2^third · low³, by bisection.
    let want = (1u128 << third) * u128::from(low).pow(3);
    let (mut lo, mut hi) = (low, 2 * low);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if u128::from(mid).pow(3) >= want {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    lo
}

/// Counts of pages per age bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Histogram {
    counts: [u32; BUCKETS],
}

impl Default for Histogram {
    fn default() -> Self {
        Self {
            counts: [0; BUCKETS],
        }
    }
}

impl Histogram {
    pub fn add(&mut self, age_ms: u64) {
        let b = bucket(age_ms);
        self.counts[b] = self.counts[b].saturating_add(1);
    }

    pub fn count(&self, b: usize) -> u32 {
        self.counts[b]
    }

    pub fn total(&self) -> u64 {
        self.counts.iter().map(|&c| u64::from(c)).sum()
    }

    /// The non-empty buckets, oldest first: what goes on the wire.
    pub fn nonempty(&self) -> impl Iterator<Item = (usize, u32)> + '_ {
        (0..BUCKETS)
            .rev()
            .filter(|&b| self.counts[b] > 0)
            .map(|b| (b, self.counts[b]))
    }

    /// From (bucket, count) pairs as received; `None` for a bucket out of range.
    pub fn from_pairs(pairs: impl IntoIterator<Item = (usize, u32)>) -> Option<Self> {
        let mut h = Self::default();
        for (b, c) in pairs {
            let slot = h.counts.get_mut(b)?;
            *slot = slot.saturating_add(c);
        }
        Some(h)
    }
}

/// What a node tells the initiator at an epoch's start: how many frames it has free and the
/// ages of the pages it could give up (local and global, global ones boosted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    pub node: NodeId,
    pub free: u32,
    /// Pages the node evicted (forwarded or dropped) since its last summary.
    pub evicted: u32,
    /// Pages that left the cluster from this node since its last summary (dropped, or given
    /// up for a forwarded page): the initiator sizes M, the replacements an epoch plans for,
    /// from them (§3.2: "the expected rate at which pages will be discarded").
    pub discarded: u32,
    pub ages: Histogram,
}

impl Summary {
    /// Pages and free frames together: everything this node could take a global page into.
    pub fn frames(&self) -> u64 {
        u64::from(self.free) + self.ages.total()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn buckets_are_three_a_doubling() {
        assert_eq!(bucket(0), 0);
        assert_eq!(bucket(1), 1);
        assert_eq!(bucket(2), 4);
        assert_eq!(bucket(3), 5); // 3 ≥ 2^(1/3)·2 = 2.52, < 2^(2/3)·2 = 3.17
        assert_eq!(bucket(4), 7);
        assert_eq!(bucket(1000), 3 * 9 + 2 + 1); // 1000 ≥ 2^(2/3)·512 = 812.7
        assert_eq!(bucket(u64::MAX), BUCKETS - 1);
        assert_eq!(bucket_floor_ms(0), 0);
        assert_eq!(bucket_floor_ms(1), 1);
        assert_eq!(bucket_floor_ms(5), 3);
        assert_eq!(bucket_floor_ms(7), 4);
    }

    proptest! {
        #[test]
        fn an_age_is_at_least_its_buckets_floor_and_below_the_next(age in 0u64..1 << 40) {
            let b = bucket(age);
            prop_assert!(bucket_floor_ms(b) <= age);
            if b + 1 < BUCKETS {
                prop_assert!(age < bucket_floor_ms(b + 1));
            }
        }

        #[test]
        fn older_never_lands_in_a_younger_bucket(a in any::<u64>(), b in any::<u64>()) {
            let (young, old) = if a <= b { (a, b) } else { (b, a) };
            prop_assert!(bucket(young) <= bucket(old));
        }

        #[test]
        fn pairs_round_trip(ages in proptest::collection::vec(any::<u64>(), 0..200)) {
            let mut h = Histogram::default();
            for &a in &ages {
                h.add(a);
            }
            prop_assert_eq!(h.total(), ages.len() as u64);
            let back = Histogram::from_pairs(h.nonempty()).unwrap();
            prop_assert_eq!(back, h);
        }
    }

    #[test]
    fn a_bucket_out_of_range_is_refused() {
        assert!(Histogram::from_pairs([(BUCKETS, 1)]).is_none());
    }
}
