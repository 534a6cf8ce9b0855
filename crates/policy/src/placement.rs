//! Placement of a new page by two weighted random choices (Anemone §2.6, with the
//! power-of-two-choices refinement): draw two candidate servers with probability proportional
//! to their free capacity, then keep the one with the lower request load.
//!
//! Weighting by free capacity balances memory use (Anemone's first criterion); comparing load
//! between the two balances paging traffic (the second); sampling instead of scanning for the
//! best keeps every client from piling onto the same "best" server between two load reports.

/// What a client knows of one server, from its handshake and the load piggy-backed on replies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Candidate {
    pub alive: bool,
    pub free_pages: u64,
    pub requests_per_s: u32,
}

impl Candidate {
    fn eligible(&self) -> bool {
        self.alive && self.free_pages > 0
    }
}

/// Picks a server for a new page among `servers`, skipping those in `exclude` (ones that just
/// refused this page, or that already hold a piece of its redundancy group). `None` when no
/// server is alive with free room: the caller spills to local disk.
pub fn choose(servers: &[Candidate], exclude: &[usize], rng: &mut fastrand::Rng) -> Option<usize> {
    let weight = |i: usize| -> u64 {
        let c = &servers[i];
        if c.eligible() && !exclude.contains(&i) {
            c.free_pages
        } else {
            0
        }
    };
    let total: u128 = (0..servers.len()).map(|i| u128::from(weight(i))).sum();
    if total == 0 {
        return None;
    }
    let mut draw = || {
        let mut x = rng.u128(0..total);
        for i in 0..servers.len() {
            let w = u128::from(weight(i));
            if x < w {
                return i;
            }
            x -= w;
        }
        unreachable!("the draw is below the total weight")
    };
    let (a, b) = (draw(), draw());
    let key = |i: usize| {
        (
            servers[i].requests_per_s,
            std::cmp::Reverse(servers[i].free_pages),
        )
    };
    Some(if key(b) < key(a) { b } else { a })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn c(alive: bool, free_pages: u64, requests_per_s: u32) -> Candidate {
        Candidate {
            alive,
            free_pages,
            requests_per_s,
        }
    }

    #[test]
    fn nothing_eligible_means_spill() {
        let mut rng = fastrand::Rng::with_seed(1);
        assert_eq!(choose(&[], &[], &mut rng), None);
        assert_eq!(
            choose(&[c(false, 10, 0), c(true, 0, 0)], &[], &mut rng),
            None
        );
        assert_eq!(choose(&[c(true, 10, 0)], &[0], &mut rng), None);
    }

    #[test]
    fn more_free_room_gets_more_pages() {
        let mut rng = fastrand::Rng::with_seed(2);
        let servers = [c(true, 1000, 0), c(true, 100, 0), c(true, 100, 0)];
        let mut hits = [0u32; 3];
        for _ in 0..10_000 {
            hits[choose(&servers, &[], &mut rng).unwrap()] += 1;
        }
        assert!(hits[0] > 6 * hits[1] && hits[0] > 6 * hits[2], "{hits:?}");
        assert!(
            hits[1] > 0 && hits[2] > 0,
            "every server with room gets some: {hits:?}"
        );
    }

    #[test]
    fn the_less_loaded_of_two_wins() {
        let mut rng = fastrand::Rng::with_seed(3);
        let servers = [c(true, 100, 5000), c(true, 100, 10)];
        let mut hits = [0u32; 2];
        for _ in 0..10_000 {
            hits[choose(&servers, &[], &mut rng).unwrap()] += 1;
        }
        // The loaded one wins only when both draws land on it: about a quarter of the time.
        assert!(hits[0] > 2000 && hits[0] < 3000, "{hits:?}");
    }

    proptest! {
        #[test]
        fn choice_is_always_eligible(
            servers in prop::collection::vec((any::<bool>(), 0u64..1000, any::<u32>()), 0..8),
            exclude in prop::collection::vec(0usize..8, 0..3),
            seed: u64,
        ) {
            let servers: Vec<_> = servers.into_iter().map(|(a, f, l)| c(a, f, l)).collect();
            let mut rng = fastrand::Rng::with_seed(seed);
            let any_ok = servers.iter().enumerate().any(|(i, s)| s.eligible() && !exclude.contains(&i));
            match choose(&servers, &exclude, &mut rng) {
                Some(i) => prop_assert!(servers[i].eligible() && !exclude.contains(&i)),
                None => prop_assert!(!any_ok),
            }
        }
    }
}
