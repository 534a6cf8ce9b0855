//! What each simulated node does: which pages it touches, how fast, and what it starts with.
//!
//! The reference traces are synthetic with the GMS paper's shapes (§5.5–5.6): one node whose
//! working set is larger than its memory (the paper's 007 benchmark: random accesses over the
//! set), nodes that loop over their own memory, half of it pages shared with the other such
//! nodes (Fig. 10's synthetic program), and idle nodes whose memory holds pages nobody has
//! touched for an hour.

use netram_policy::gms::Uid;

/// A node's access pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pattern {
    /// Touches nothing.
    Idle,
    /// Uniformly random over `pages` pages of its own.
    Uniform { pages: u64 },
    /// Over `pages` pages in order, round and round; the first `shared` of them are pages of
    /// data set `group`, which every looping node of that group reads (the same ids on every
    /// such node).
    Loop { pages: u64, shared: u64, group: u64 },
}

/// One node of a simulated cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSpec {
    /// Frames of memory.
    pub capacity: usize,
    /// Frames that hold idle pages at the start (an hour old, never touched again); the rest
    /// of the memory the pattern fills as it goes.
    pub idle_pages: usize,
    pub pattern: Pattern,
    /// Computation between two accesses, µs.
    pub think_us: u64,
    /// Accesses it makes; `None`: until the run ends.
    pub accesses: Option<u64>,
}

impl NodeSpec {
    pub fn idle(capacity: usize) -> Self {
        Self {
            capacity,
            idle_pages: capacity,
            pattern: Pattern::Idle,
            think_us: 0,
            accesses: None,
        }
    }
}

/// The page ids: a node's own pages carry its index + 1 in the top half; the shared data set
/// has 0 there; idle pages have the top bit of the bottom half set.
pub fn own_page(node: usize, page: u64) -> Uid {
    Uid(((node as u128 + 1) << 64) | u128::from(page & !(1 << 63)))
}

/// Page `page` (< 2^40) of shared data set `group`.
pub fn shared_page(group: u64, page: u64) -> Uid {
    Uid((u128::from(group) << 40) | u128::from(page & ((1 << 40) - 1)))
}

pub fn idle_page(node: usize, page: u64) -> Uid {
    Uid(((node as u128 + 1) << 64) | u128::from(page | (1 << 63)))
}

/// A node's position in its pattern.
#[derive(Debug, Clone)]
pub struct Trace {
    node: usize,
    pattern: Pattern,
    cursor: u64,
}

impl Trace {
    pub fn new(node: usize, pattern: Pattern) -> Self {
        Self {
            node,
            pattern,
            cursor: 0,
        }
    }

    /// The next page; `None` for an idle node.
    pub fn next(&mut self, rng: &mut fastrand::Rng) -> Option<Uid> {
        match self.pattern {
            Pattern::Idle => None,
            Pattern::Uniform { pages } => Some(own_page(self.node, rng.u64(0..pages.max(1)))),
            Pattern::Loop {
                pages,
                shared,
                group,
            } => {
                let p = self.cursor % pages.max(1);
                self.cursor += 1;
                Some(if p < shared {
                    shared_page(group, p)
                } else {
                    own_page(self.node, p)
                })
            }
        }
    }

    /// The pages it will touch, for warming its memory at the start.
    pub fn working_set(&self) -> Vec<Uid> {
        match self.pattern {
            Pattern::Idle => Vec::new(),
            Pattern::Uniform { pages } => (0..pages).map(|p| own_page(self.node, p)).collect(),
            Pattern::Loop {
                pages,
                shared,
                group,
            } => (0..pages)
                .map(|p| {
                    if p < shared {
                        shared_page(group, p)
                    } else {
                        own_page(self.node, p)
                    }
                })
                .collect(),
        }
    }
}
