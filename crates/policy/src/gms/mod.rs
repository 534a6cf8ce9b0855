//! Global memory management (GMS, paper 000, §3–4): all of a cluster's memory managed as one
//! cache of clean pages, so that on every fault the cluster keeps its globally most valuable
//! pages in memory and an idle machine's memory fills with busy machines' older pages.
//!
//! A page a node uses itself is *local*; a page it holds for others is *global*. A node that
//! must free a frame evicts its oldest page; whether that page is dropped or forwarded, and to
//! whom, is decided cluster-wide by *epochs* (§3.2): at an epoch's start every node sends the
//! initiator a summary of its page ages ([`age::Summary`]); the initiator computes each node's
//! weight wᵢ — how many of the cluster's M oldest pages it holds — and MinAge, the age beyond
//! which a page is among those M ([`epoch::Plan`]); during the epoch an evicted page older than
//! MinAge is dropped and any other goes to node i with probability wᵢ/M, where it replaces
//! that node's oldest page. Global pages age faster than local ones (§3.1's cost function).
//!
//! Every page handled here is clean — it also exists in a source (a file, the owner's disk) —
//! so dropping one costs a read, never data; that is what lets a full cluster choose instead of
//! refusing (§3.3), and why a node that leaves mid-epoch loses nobody's data.
//!
//! The pieces, each a state machine without I/O driven by the daemon, the front ends and the
//! simulator alike:
//! - [`age`]: age histograms and the summary a node sends;
//! - [`epoch`]: the initiator's computation, the plan, the eviction rule, and [`epoch::Epochs`],
//!   a node's part in starting, ending and taking over epochs;
//! - [`frames`]: a node's page-frame directory (its local and global pages, oldest first);
//! - [`directory`]: the page-ownership directory by rendezvous hashing over the live members,
//!   and the global-cache directory's partition of it;
//! - [`nchance`]: N-chance forwarding (§5.5's version of Dahlin et al.), the baseline.

pub mod age;
pub mod directory;
pub mod epoch;
pub mod frames;
pub mod nchance;

/// A page's cluster-wide identity: 128 bits, like GMS's (IP, partition, inode, offset) UID
/// (§4.1). A file page's is made by the front end from (source, file, offset, the file's
/// version), so a changed file's pages get new ids and the old ones age out; an anonymous
/// page's from (owner, region, page). The algorithm only compares and hashes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Uid(pub u128);

/// A member of the cluster, by the node id its certificate names.
pub type NodeId = u64;

/// How much faster a global page ages than a local one (§3.1: "boosts the ages of global pages
/// to favor their replacement over local pages of approximately the same age"): mistakenly
/// dropping a local page costs its owner a fetch now, a global one costs a fetch from the
/// source later, if ever.
pub const GLOBAL_AGE_BOOST: u64 = 2;

/// A page's age as the algorithm compares it: global pages boosted.
pub fn effective_age_ms(age_ms: u64, global: bool) -> u64 {
    if global {
        age_ms.saturating_mul(GLOBAL_AGE_BOOST)
    } else {
        age_ms
    }
}
