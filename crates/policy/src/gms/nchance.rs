//! N-chance forwarding, the baseline GMS is measured against (GMS §5.5, after Dahlin et al.):
//! no global knowledge, a random target, and singlets kept in the cluster at the cost of
//! duplicates.
//!
//! A *singlet* (the only cached copy in the cluster) that a node evicts is forwarded to a node
//! chosen at random with a recirculation count of N = 2; a duplicate is dropped. A node that
//! receives one takes it into a free frame, or else drops, in this order, its oldest duplicate,
//! its oldest recirculating page, or a very old singlet; if it has none of those, the page's
//! count goes down by one and it is forwarded again, or dropped at zero. These are GMS's own
//! "few minor modifications" of the original algorithm, kept so that the comparison is the
//! paper's.

use super::frames::{Frames, Kind, Meta};
use super::{NodeId, Uid};

/// The recirculation count a singlet starts with.
pub const N: u8 = 2;

/// What a node does with a page it evicts: `Some(count)` forward it with that count, `None`
/// drop it. A recirculating page spends one chance each time it is passed on.
pub fn on_evict(kind: Kind, meta: &Meta, duplicate: bool) -> Option<u8> {
    if duplicate || meta.duplicate {
        return None;
    }
    match kind {
        Kind::Local => Some(N),
        Kind::Global => meta.chances.checked_sub(1).filter(|&c| c > 0),
    }
}

/// What a node did with a page forwarded to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrive {
    /// Taken; the page it displaced, if any, was dropped.
    Taken(Option<(Uid, Kind)>),
    /// No victim here: pass it on with this many chances left.
    Pass(u8),
    /// No victim and no chances left: dropped.
    Drop,
}

/// A page forwarded to this node with `meta.chances` chances; singlets older than
/// `very_old_ms` may be displaced.
pub fn arrive(frames: &mut Frames, uid: Uid, meta: Meta, now_ms: u64, very_old_ms: u64) -> Arrive {
    if frames.kind(&uid).is_some() {
        return Arrive::Taken(None);
    }
    if frames.free() > 0 {
        frames.insert_global(uid, meta);
        return Arrive::Taken(None);
    }
    let victim = frames
        .oldest_matching(Kind::Local, |m| m.duplicate)
        .map(|u| (u, Kind::Local))
        .or_else(|| {
            frames
                .oldest_matching(Kind::Global, |m| m.duplicate)
                .map(|u| (u, Kind::Global))
        })
        .or_else(|| {
            frames
                .oldest_matching(Kind::Global, |_| true)
                .map(|u| (u, Kind::Global))
        })
        .or_else(|| {
            let old = |m: &Meta| now_ms.saturating_sub(m.last_ms) >= very_old_ms;
            frames
                .oldest_matching(Kind::Local, old)
                .map(|u| (u, Kind::Local))
        });
    match victim {
        Some((v, kind)) => {
            frames.remove(&v);
            frames.insert_global(uid, meta);
            Arrive::Taken(Some((v, kind)))
        }
        None => match meta.chances.saturating_sub(1) {
            0 => Arrive::Drop,
            c => Arrive::Pass(c),
        },
    }
}

/// A random member other than `me`.
pub fn target(me: NodeId, members: &[NodeId], rng: &mut fastrand::Rng) -> Option<NodeId> {
    let others = members.iter().filter(|&&n| n != me).count();
    if others == 0 {
        return None;
    }
    members
        .iter()
        .filter(|&&n| n != me)
        .nth(rng.usize(0..others))
        .copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(last_ms: u64, duplicate: bool, chances: u8) -> Meta {
        Meta {
            last_ms,
            duplicate,
            chances,
        }
    }

    #[test]
    fn singlets_get_n_chances_duplicates_none() {
        assert_eq!(on_evict(Kind::Local, &meta(0, false, 0), false), Some(N));
        assert_eq!(on_evict(Kind::Local, &meta(0, true, 0), false), None);
        assert_eq!(on_evict(Kind::Local, &meta(0, false, 0), true), None);
        assert_eq!(on_evict(Kind::Global, &meta(0, false, 2), false), Some(1));
        assert_eq!(on_evict(Kind::Global, &meta(0, false, 1), false), None);
    }

    #[test]
    fn a_full_node_displaces_duplicates_then_recirculating_then_very_old_singlets() {
        let mut f = Frames::new(3);
        f.insert_local(Uid(1), 100, false);
        f.insert_local(Uid(2), 200, true);
        f.insert_global(Uid(3), meta(300, false, 2));
        let incoming = meta(400, false, 2);
        assert_eq!(
            arrive(&mut f, Uid(10), incoming, 1000, 10_000),
            Arrive::Taken(Some((Uid(2), Kind::Local)))
        );
        assert_eq!(
            arrive(&mut f, Uid(11), incoming, 1000, 10_000),
            Arrive::Taken(Some((Uid(3), Kind::Global)))
        );
        // Now: local 1 (a young singlet), globals 10 and 11 (recirculating).
        assert_eq!(
            arrive(&mut f, Uid(12), incoming, 1000, 10_000),
            Arrive::Taken(Some((Uid(10), Kind::Global)))
        );
        let mut g = Frames::new(1);
        g.insert_local(Uid(1), 100, false);
        assert_eq!(
            arrive(&mut g, Uid(2), incoming, 1000, 10_000),
            Arrive::Pass(1)
        );
        assert_eq!(
            arrive(&mut g, Uid(2), meta(400, false, 1), 1000, 10_000),
            Arrive::Drop
        );
        assert_eq!(
            arrive(&mut g, Uid(2), incoming, 20_000, 10_000),
            Arrive::Taken(Some((Uid(1), Kind::Local)))
        );
    }

    #[test]
    fn the_target_is_never_the_sender() {
        let mut rng = fastrand::Rng::with_seed(3);
        assert_eq!(target(1, &[1], &mut rng), None);
        for _ in 0..100 {
            assert_ne!(target(1, &[1, 2, 3], &mut rng), Some(1));
        }
    }
}
