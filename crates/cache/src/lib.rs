//! `netram cache`: a read-only FUSE file system that mirrors a directory (a local one, or a
//! network file system's mount) and keeps its files' pages in memory, so that data sets,
//! model weights, build trees or VM images bigger than one machine's RAM are read from memory
//! (GMS, paper 000, §4.1: file pages named by (source, file, offset); issue 39).
//!
//! - [`tree`]: the source directory as inodes: names, attributes, the files' identities.
//! - [`pages`]: the pages this machine holds, within its budget (`--local-mem`), oldest out
//!   first; a page is read from the source on a miss.
//! - [`fs`]: the FUSE file system over both.
//!
//! **One copy of each page on this machine.** The kernel's page cache would keep a second
//! copy of every page read through the mount, and of every page this file system reads from
//! the source, outside netram's budget and invisible to it. So: files are opened with
//! `FOPEN_DIRECT_IO` (every read comes here; the kernel caches none of it), and after reading
//! a page from the source the range is dropped from the source's page cache
//! (`POSIX_FADV_DONTNEED`). What a machine holds of the data set is then exactly this budget.
//!
//! **A page's identity** is a 128-bit uid: the file's key (a hash of the source, the file's
//! device, inode, size and modification time; for a source named with `--source-name`, of the
//! name, the file's path below the source, its size and modification time, which is the same
//! on every machine that mirrors it) and the page's index. A file changed at its source
//! (checked at every open) gets a new key, so its old pages are never read again and age out;
//! they cannot be served for the new contents.
//!
//! - [`cluster`]: with a cluster, where the pages this machine drops go (by the GMS epoch's
//!   plan, to other machines' daemons) and where a miss looks before the source; every page
//!   that comes back is checked against what was sent.
//! - [`shared`]: for a named source, which of this machine's pages the cluster's global-cache
//!   directory knows it holds, so that a page another machine also holds (a duplicate) goes
//!   first when it leaves (GMS §4.4–4.5).
//! - [`metrics`]: the counters in Prometheus' text format, in a file that node_exporter's
//!   textfile collector serves on its `/metrics`.

pub mod cluster;
pub mod fs;
pub mod metrics;
pub mod pages;
pub mod shared;
pub mod tree;

pub use cluster::{Cluster, ClusterConfig, Placement};
pub use fs::{mount, Mounted};
pub use pages::{Counters, Pages};
pub use tree::Tree;
