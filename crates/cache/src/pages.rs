//! The pages of the mirrored files this machine holds: at most its budget, the least recently
//! read out first (GMS's local pages, §3.1). A page missing here is asked of the cluster, when
//! there is one ([`crate::cluster`]: where the pages this machine dropped went), then read from
//! the source; a page dropped goes to the cluster with its age.
//!
//! The lock is never held across a read of the source: two readers of the same missing page
//! may both read it (counted as two misses), which is cheaper than making one wait behind
//! another file's slow read.

use crate::cluster::Cluster;
use netram_policy::gms::Uid;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Bytes of a page.
pub const PAGE: usize = 4096;

/// What the cache did, one counter per outcome.
#[derive(Debug, Default)]
pub struct Counters {
    /// Pages found in this machine's memory.
    pub hits: AtomicU64,
    /// Pages found in the cluster (or still on their way there).
    pub cluster_hits: AtomicU64,
    /// Pages read from the source.
    pub source_reads: AtomicU64,
    pub source_bytes: AtomicU64,
    /// Pages dropped to stay within the budget.
    pub evicted: AtomicU64,
    /// Files found changed at their source when opened: their old pages are never read again.
    pub files_changed: AtomicU64,
    /// Reads of the source that failed (the reader got EIO).
    pub source_errors: AtomicU64,
}

impl Counters {
    pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        vec![
            ("hits", g(&self.hits)),
            ("cluster_hits", g(&self.cluster_hits)),
            ("source_reads", g(&self.source_reads)),
            ("source_bytes", g(&self.source_bytes)),
            ("evicted", g(&self.evicted)),
            ("files_changed", g(&self.files_changed)),
            ("source_errors", g(&self.source_errors)),
        ]
    }
}

/// A page held, and when it was last read (ms since the start).
type Held = lru::LruCache<Uid, (Box<[u8]>, u64)>;

/// The pages held, and the budget.
#[derive(Debug)]
pub struct Pages {
    budget: usize,
    held: Mutex<Held>,
    cluster: Option<Arc<Cluster>>,
    start: Instant,
    pub counters: Counters,
}

impl Pages {
    /// At most `budget` pages (at least one), on this machine alone.
    pub fn new(budget: usize) -> Self {
        Self::with_cluster(budget, None)
    }

    /// At most `budget` pages here; those dropped go to `cluster`, and a miss asks it first.
    pub fn with_cluster(budget: usize, cluster: Option<Arc<Cluster>>) -> Self {
        Self {
            budget: budget.max(1),
            held: Mutex::new(lru::LruCache::unbounded()),
            cluster,
            start: Instant::now(),
            counters: Counters::default(),
        }
    }

    fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    pub fn budget(&self) -> usize {
        self.budget
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Appends bytes `from..to` of page `uid` to `out`, reading the whole page with `source`
    /// on a miss (it fills the buffer it is given and returns how many bytes it read; the rest
    /// of the page reads as zeros, as past the end of a file).
    pub fn read(
        &self,
        uid: Uid,
        from: usize,
        to: usize,
        out: &mut Vec<u8>,
        source: impl FnOnce(&mut [u8]) -> std::io::Result<usize>,
    ) -> std::io::Result<()> {
        let mut source = Some(source);
        self.read_pages(&[(uid, from, to)], out, |_, buf| {
            (source.take().expect("one page, one read"))(buf)
        })
    }

    /// Appends bytes `from..to` of each page `(uid, from, to)` to `out`, in order. Pages not
    /// held here are asked of the cluster all at once (one request per member), and those it
    /// does not have are read from the source by runs of consecutive ones: `source(i, buf)`
    /// fills `buf` (a whole number of pages) with pages `i..` of `pages` and returns the bytes
    /// it read (the rest reads as zeros, as past the end of a file).
    pub fn read_pages(
        &self,
        pages: &[(Uid, usize, usize)],
        out: &mut Vec<u8>,
        mut source: impl FnMut(usize, &mut [u8]) -> std::io::Result<usize>,
    ) -> std::io::Result<()> {
        debug_assert!(pages.iter().all(|&(_, f, t)| f <= t && t <= PAGE));
        let now = self.now_ms();
        // Copies of the pages held (a page may leave while the others are fetched).
        let mut have: Vec<Option<Box<[u8]>>> = {
            let mut held = self.lock();
            pages
                .iter()
                .map(|(uid, _, _)| {
                    held.get_mut(uid).map(|(p, last)| {
                        *last = now;
                        p.clone()
                    })
                })
                .collect()
        };
        let hits = have.iter().filter(|p| p.is_some()).count() as u64;
        self.counters.hits.fetch_add(hits, Ordering::Relaxed);
        let mut new = Vec::new();
        if let Some(c) = &self.cluster {
            let missing: Vec<usize> = (0..pages.len()).filter(|&i| have[i].is_none()).collect();
            if !missing.is_empty() {
                let uids: Vec<Uid> = missing.iter().map(|&i| pages[i].0).collect();
                for (i, got) in missing.into_iter().zip(c.fetch_many(&uids)) {
                    if let Some(p) = got {
                        self.counters.cluster_hits.fetch_add(1, Ordering::Relaxed);
                        have[i] = Some(p.clone());
                        new.push((pages[i].0, p));
                    }
                }
            }
        }
        let mut i = 0;
        while i < pages.len() {
            if have[i].is_some() {
                i += 1;
                continue;
            }
            let run = (i..pages.len()).take_while(|&j| have[j].is_none()).count();
            let mut buf = vec![0u8; run * PAGE];
            let n = match source(i, &mut buf) {
                Ok(n) => n,
                Err(e) => {
                    self.counters.source_errors.fetch_add(1, Ordering::Relaxed);
                    return Err(e);
                }
            };
            self.counters
                .source_reads
                .fetch_add(run as u64, Ordering::Relaxed);
            self.counters
                .source_bytes
                .fetch_add(n as u64, Ordering::Relaxed);
            for (k, chunk) in buf.chunks(PAGE).enumerate() {
                let page: Box<[u8]> = chunk.into();
                have[i + k] = Some(page.clone());
                new.push((pages[i + k].0, page));
            }
            i += run;
        }
        for ((_, from, to), p) in pages.iter().zip(&have) {
            out.extend_from_slice(&p.as_ref().expect("every page found")[*from..*to]);
        }
        self.hold(new, now);
        Ok(())
    }

    /// Keeps `pages`, dropping the least recently read beyond the budget (to the cluster, with
    /// their ages, once the lock is released: the outbox may make the caller wait).
    fn hold(&self, pages: Vec<(Uid, Box<[u8]>)>, now: u64) {
        let mut out = Vec::new();
        let mut fresh = Vec::new();
        {
            let mut held = self.lock();
            for (uid, page) in pages {
                if held.put(uid, (page, now)).is_none() {
                    fresh.push(uid);
                }
            }
            while held.len() > self.budget {
                if let Some(p) = held.pop_lru() {
                    out.push(p);
                }
                self.counters.evicted.fetch_add(1, Ordering::Relaxed);
            }
        }
        if let Some(c) = &self.cluster {
            c.resident(&fresh);
            for (uid, (page, last)) in out {
                c.evicted(uid, now.saturating_sub(last), page);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_is_read_from_the_source_once_and_the_oldest_leaves_first() {
        let p = Pages::new(2);
        let mut out = Vec::new();
        let fill = |b: u8| {
            move |buf: &mut [u8]| -> std::io::Result<usize> {
                buf.fill(b);
                Ok(PAGE)
            }
        };
        p.read(Uid(1), 0, 10, &mut out, fill(1)).unwrap();
        p.read(Uid(2), 0, 10, &mut out, fill(2)).unwrap();
        p.read(Uid(1), 5, 6, &mut out, |_| panic!("held")).unwrap();
        p.read(Uid(3), 0, 1, &mut out, fill(3)).unwrap(); // page 2 leaves
        p.read(Uid(2), 0, 1, &mut out, fill(9)).unwrap();
        assert_eq!(out[..10], [1; 10]);
        assert_eq!(out[20..], [1, 3, 9]);
        let c = p.counters.snapshot();
        assert_eq!(c[0], ("hits", 1));
        assert_eq!(c[2], ("source_reads", 4));
        assert_eq!(c[4], ("evicted", 2));
        assert_eq!(p.len(), 2);
        // A short read (the end of a file) reads as zeros beyond it; an error is counted.
        p.read(Uid(4), 0, PAGE, &mut out, |b| {
            b[..3].fill(7);
            Ok(3)
        })
        .unwrap();
        assert_eq!(out[out.len() - PAGE..out.len() - PAGE + 4], [7, 7, 7, 0]);
        assert!(p
            .read(Uid(5), 0, 1, &mut out, |_| Err(std::io::Error::other(
                "gone"
            )))
            .is_err());
        assert_eq!(p.counters.snapshot()[6], ("source_errors", 1));
    }

    /// A read's missing pages come from the source by runs of consecutive ones, and the bytes
    /// come out in order, held and fetched ones alike.
    #[test]
    fn missing_pages_are_read_by_runs_in_order() {
        let p = Pages::new(16);
        let page = |i: u64| vec![i as u8; PAGE];
        let mut out = Vec::new();
        for i in [1u64, 3] {
            p.read(Uid(u128::from(i)), 0, 1, &mut out, |b| {
                b.copy_from_slice(&page(i));
                Ok(PAGE)
            })
            .unwrap();
        }
        let want: Vec<(Uid, usize, usize)> =
            (0..6u64).map(|i| (Uid(u128::from(i)), 10, 20)).collect();
        let mut runs = Vec::new();
        out.clear();
        p.read_pages(&want, &mut out, |i, buf| {
            runs.push((i, buf.len() / PAGE));
            for (k, chunk) in buf.chunks_mut(PAGE).enumerate() {
                chunk.fill((i + k) as u8);
            }
            Ok(buf.len())
        })
        .unwrap();
        assert_eq!(runs, [(0, 1), (2, 1), (4, 2)]);
        let expected: Vec<u8> = (0..6u8).flat_map(|i| [i; 10]).collect();
        assert_eq!(out, expected);
        let c = p.counters.snapshot();
        assert_eq!(c[0], ("hits", 2));
        assert_eq!(c[2], ("source_reads", 6)); // 2 at first, then 4
    }
}
