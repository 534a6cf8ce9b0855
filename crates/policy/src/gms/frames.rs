//! A node's page-frame directory (GMS §4.1's PFD): the pages it holds, local or global, in
//! the order of their last use, and its frame budget.
//!
//! Local pages are the node's own working set; global pages are held for others. The oldest
//! page by effective age (global ones boosted, [`super::effective_age_ms`]) is the next to
//! go. Used as is by the simulator, which models GMS's nodes whole; in the real system a front
//! end's local pages and a daemon's global pages live in different processes, each with its
//! own budget (the front end's `--local-mem`, the daemon's offer), so each keeps one kind.
//!
//! The receiving rule [`Frames::accept_global`] is where a node's own evidence outweighs the
//! plan: it gives up a page for a forwarded one only if that page is at least as old.

use super::age::Summary;
use super::{effective_age_ms, NodeId, Uid};
use lru::LruCache;
use std::collections::{BTreeSet, HashMap};

/// Whether a page is the node's own or held for another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Local,
    Global,
}

/// What a node knows of a page it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Meta {
    /// When it was last used (ms on the node's clock); for a global page, as its sender said.
    pub last_ms: u64,
    /// Another node holds it in local memory too (a shared page): it goes first.
    pub duplicate: bool,
    /// N-chance's recirculation count; 0 for pages that are not recirculating.
    pub chances: u8,
}

/// What became of a page offered to this node as a global page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accept {
    /// Taken into a free frame.
    Free,
    /// Taken in place of this page of the node's, which it dropped.
    Replaced(Uid, Kind),
    /// Refused: every page here is younger than it (the plan was wrong).
    Refused,
    /// Already here: nothing changed.
    Present,
}

/// Global pages, in order of their last use rather than of their arrival: a page forwarded
/// here comes with the age its sender gives it, so the last to arrive is not the youngest.
#[derive(Debug, Default)]
struct ByAge {
    pages: HashMap<Uid, Meta, foldhash::fast::FixedState>,
    order: BTreeSet<(u64, Uid)>,
}

impl ByAge {
    fn len(&self) -> usize {
        self.pages.len()
    }
    fn contains(&self, uid: &Uid) -> bool {
        self.pages.contains_key(uid)
    }
    fn peek(&self, uid: &Uid) -> Option<&Meta> {
        self.pages.get(uid)
    }
    fn put(&mut self, uid: Uid, meta: Meta) {
        if let Some(old) = self.pages.insert(uid, meta) {
            self.order.remove(&(old.last_ms, uid));
        }
        self.order.insert((meta.last_ms, uid));
    }
    fn pop(&mut self, uid: &Uid) -> Option<Meta> {
        let m = self.pages.remove(uid)?;
        self.order.remove(&(m.last_ms, *uid));
        Some(m)
    }
    fn set_duplicate(&mut self, uid: &Uid, duplicate: bool) -> bool {
        self.pages
            .get_mut(uid)
            .map(|m| m.duplicate = duplicate)
            .is_some()
    }
    fn touch(&mut self, uid: Uid, now_ms: u64) -> bool {
        let Some(m) = self.pages.get_mut(&uid) else {
            return false;
        };
        self.order.remove(&(m.last_ms, uid));
        m.last_ms = m.last_ms.max(now_ms);
        self.order.insert((m.last_ms, uid));
        true
    }
    fn oldest(&self) -> Option<(Uid, &Meta)> {
        let &(_, uid) = self.order.first()?;
        Some((uid, &self.pages[&uid]))
    }
    /// Oldest first.
    fn iter(&self) -> impl Iterator<Item = (Uid, &Meta)> + '_ {
        self.order.iter().map(|&(_, u)| (u, &self.pages[&u]))
    }
}

/// The pages one node holds.
#[derive(Debug)]
pub struct Frames {
    capacity: usize,
    local: LruCache<Uid, Meta>,
    global: ByAge,
}

impl Frames {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            local: LruCache::unbounded(),
            global: ByAge::default(),
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// A new budget (the donor's offer changed). When it shrank, the caller evicts with
    /// [`Frames::pop_oldest`] until [`Frames::over`] is 0.
    pub fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity;
    }

    pub fn len(&self) -> usize {
        self.local.len() + self.global.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn local_len(&self) -> usize {
        self.local.len()
    }

    pub fn global_len(&self) -> usize {
        self.global.len()
    }

    pub fn free(&self) -> usize {
        self.capacity.saturating_sub(self.len())
    }

    /// Pages over the budget.
    pub fn over(&self) -> usize {
        self.len().saturating_sub(self.capacity)
    }

    pub fn kind(&self, uid: &Uid) -> Option<Kind> {
        if self.local.contains(uid) {
            Some(Kind::Local)
        } else if self.global.contains(uid) {
            Some(Kind::Global)
        } else {
            None
        }
    }

    pub fn meta(&self, uid: &Uid) -> Option<Meta> {
        self.local
            .peek(uid)
            .or_else(|| self.global.peek(uid))
            .copied()
    }

    /// The node uses a page: a hit if it is here. A global page used by its holder becomes a
    /// local one (the holder reads the same file page itself).
    pub fn touch(&mut self, uid: Uid, now_ms: u64) -> bool {
        if let Some(m) = self.local.get_mut(&uid) {
            m.last_ms = now_ms;
            return true;
        }
        if let Some(mut m) = self.global.pop(&uid) {
            m.last_ms = now_ms;
            m.chances = 0;
            self.local.put(uid, m);
            return true;
        }
        false
    }

    /// A global page used where it is held without changing hands (a data cache's hit at the
    /// page's home): it becomes the youngest of its kind.
    pub fn touch_global(&mut self, uid: Uid, now_ms: u64) -> bool {
        self.global.touch(uid, now_ms)
    }

    /// Takes out the oldest page of one kind.
    pub fn pop_oldest_of(&mut self, kind: Kind) -> Option<(Uid, Meta)> {
        match kind {
            Kind::Local => self.local.pop_lru(),
            Kind::Global => {
                let (uid, _) = self.global.oldest()?;
                self.global.pop(&uid).map(|m| (uid, m))
            }
        }
    }

    /// A page the node just read, as a local page. The caller made room first.
    pub fn insert_local(&mut self, uid: Uid, now_ms: u64, duplicate: bool) {
        debug_assert!(self.kind(&uid).is_none(), "inserting a page already held");
        self.local.put(
            uid,
            Meta {
                last_ms: now_ms,
                duplicate,
                chances: 0,
            },
        );
    }

    pub fn set_duplicate(&mut self, uid: &Uid, duplicate: bool) {
        match self.local.peek_mut(uid) {
            Some(m) => m.duplicate = duplicate,
            None => {
                self.global.set_duplicate(uid, duplicate);
            }
        }
    }

    /// Takes a page out (a global page another node fetched, or one dropped by the caller).
    pub fn remove(&mut self, uid: &Uid) -> Option<(Kind, Meta)> {
        if let Some(m) = self.local.pop(uid) {
            return Some((Kind::Local, m));
        }
        self.global.pop(uid).map(|m| (Kind::Global, m))
    }

    /// The oldest page by effective age.
    pub fn oldest(&self, now_ms: u64) -> Option<(Uid, Kind, u64)> {
        let age = |m: &Meta, global| effective_age_ms(now_ms.saturating_sub(m.last_ms), global);
        let l = self
            .local
            .peek_lru()
            .map(|(u, m)| (*u, Kind::Local, age(m, false)));
        let g = self
            .global
            .oldest()
            .map(|(u, m)| (u, Kind::Global, age(m, true)));
        match (l, g) {
            (Some(l), Some(g)) => Some(if g.2 >= l.2 { g } else { l }),
            (l, g) => l.or(g),
        }
    }

    /// Takes out the oldest page by effective age: (page, kind, meta, effective age).
    pub fn pop_oldest(&mut self, now_ms: u64) -> Option<(Uid, Kind, Meta, u64)> {
        let (uid, kind, age) = self.oldest(now_ms)?;
        let (_, meta) = self.remove(&uid)?;
        Some((uid, kind, meta, age))
    }

    /// The oldest page of one kind that `keep` picks, oldest first (N-chance's victim search).
    pub fn oldest_matching(&self, kind: Kind, mut pick: impl FnMut(&Meta) -> bool) -> Option<Uid> {
        match kind {
            Kind::Local => self
                .local
                .iter()
                .rev()
                .find(|(_, m)| pick(m))
                .map(|(u, _)| *u),
            Kind::Global => self.global.iter().find(|(_, m)| pick(m)).map(|(u, _)| u),
        }
    }

    /// GMS's receiving rule: a forwarded page of effective age `age_ms` takes a free frame,
    /// else replaces the node's oldest page if that is at least as old, else is refused.
    pub fn accept_global(&mut self, uid: Uid, meta: Meta, now_ms: u64) -> Accept {
        if self.kind(&uid).is_some() {
            return Accept::Present;
        }
        let age = effective_age_ms(now_ms.saturating_sub(meta.last_ms), true);
        if self.free() > 0 {
            self.global.put(uid, meta);
            return Accept::Free;
        }
        match self.oldest(now_ms) {
            Some((victim, kind, victim_age)) if victim_age >= age => {
                self.remove(&victim);
                self.global.put(uid, meta);
                Accept::Replaced(victim, kind)
            }
            _ => Accept::Refused,
        }
    }

    /// Puts a global page in without the age rule (N-chance decides by its own rules).
    pub fn insert_global(&mut self, uid: Uid, meta: Meta) {
        debug_assert!(self.kind(&uid).is_none(), "inserting a page already held");
        self.global.put(uid, meta);
    }

    /// Every page held, local ones first (no particular order within a kind).
    pub fn pages(&self) -> impl Iterator<Item = (Uid, Kind)> + '_ {
        self.local
            .iter()
            .map(|(u, _)| (*u, Kind::Local))
            .chain(self.global.iter().map(|(u, _)| (u, Kind::Global)))
    }

    /// This node's summary for an epoch: its free frames and the effective ages of its pages.
    pub fn summary(&self, node: NodeId, now_ms: u64, evicted: u32, discarded: u32) -> Summary {
        let mut s = Summary {
            node,
            free: u32::try_from(self.free()).unwrap_or(u32::MAX),
            evicted,
            discarded,
            ages: Default::default(),
        };
        for (_, m) in self.local.iter() {
            s.ages
                .add(effective_age_ms(now_ms.saturating_sub(m.last_ms), false));
        }
        for (_, m) in self.global.iter() {
            s.ages
                .add(effective_age_ms(now_ms.saturating_sub(m.last_ms), true));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(last_ms: u64) -> Meta {
        Meta {
            last_ms,
            duplicate: false,
            chances: 0,
        }
    }

    #[test]
    fn global_pages_age_twice_as_fast() {
        let mut f = Frames::new(4);
        f.insert_local(Uid(1), 0, false); // age 1000
        f.insert_global(Uid(2), meta(400)); // age 600, effective 1200
        assert_eq!(f.oldest(1_000), Some((Uid(2), Kind::Global, 1_200)));
        f.insert_global(Uid(3), meta(600)); // effective 800: the local page is next after 2
        assert_eq!(f.pop_oldest(1_000).map(|x| x.0), Some(Uid(2)));
        assert_eq!(f.pop_oldest(1_000).map(|x| x.0), Some(Uid(1)));
        // A global page used by its holder becomes local.
        assert!(f.touch(Uid(3), 1_000));
        assert_eq!(f.kind(&Uid(3)), Some(Kind::Local));
        assert!(!f.touch(Uid(9), 1_000));
    }

    #[test]
    fn global_pages_go_oldest_first_whatever_order_they_came_in() {
        let mut f = Frames::new(3);
        // Sent young, old, middling: the old one goes first.
        f.insert_global(Uid(1), meta(900));
        f.insert_global(Uid(2), meta(100));
        f.insert_global(Uid(3), meta(500));
        assert_eq!(f.oldest(1_000).map(|o| o.0), Some(Uid(2)));
        assert_eq!(f.oldest_matching(Kind::Global, |_| true), Some(Uid(2)));
        // Used where it is held (a data cache's hit), it becomes the youngest.
        assert!(f.touch_global(Uid(2), 1_000));
        assert_eq!(f.pop_oldest_of(Kind::Global).map(|p| p.0), Some(Uid(3)));
        assert_eq!(f.pop_oldest(1_000).map(|p| p.0), Some(Uid(1)));
    }

    #[test]
    fn a_node_gives_up_only_a_page_at_least_as_old_as_the_one_it_is_sent() {
        let mut f = Frames::new(2);
        assert_eq!(f.accept_global(Uid(1), meta(900), 1_000), Accept::Free);
        assert_eq!(f.accept_global(Uid(1), meta(900), 1_000), Accept::Present);
        f.insert_local(Uid(2), 990, false);
        // Full; its oldest is the global page, effective age 200. A page of effective age 400
        // is refused; one of 100 replaces it.
        assert_eq!(f.accept_global(Uid(3), meta(800), 1_000), Accept::Refused);
        assert_eq!(
            f.accept_global(Uid(3), meta(950), 1_000),
            Accept::Replaced(Uid(1), Kind::Global)
        );
        assert_eq!(f.len(), 2);
    }

    #[test]
    fn a_summary_counts_free_frames_and_every_page() {
        let mut f = Frames::new(10);
        f.insert_local(Uid(1), 0, false);
        f.insert_global(Uid(2), meta(0));
        let s = f.summary(7, 1_000, 4, 3);
        assert_eq!(
            (s.node, s.free, s.evicted, s.discarded, s.ages.total()),
            (7, 8, 4, 3, 2)
        );
        assert_eq!(s.ages.count(crate::gms::age::bucket(1_000)), 1);
        assert_eq!(s.ages.count(crate::gms::age::bucket(2_000)), 1);
        f.set_capacity(1);
        assert_eq!((f.free(), f.over()), (0, 1));
    }
}
