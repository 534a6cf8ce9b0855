//! The page table: for every page of the region, its version and which servers hold it.
//!
//! An entry is 8 bytes plus 2 bytes per copy the redundancy scheme keeps (one for `none`, N for
//! `mirror:N`), kept in one flat array rather than a heap node per page, so that a 64 GiB device
//! (16 M pages) needs 160 MiB of table without mirroring. Both arrays start as zeros (an empty
//! entry, no holder), allocated zeroed: the allocator leaves their pages untouched until a page
//! of the region is used, so a table costs resident memory for the part of the region in use,
//! not for all of it (`netram run`'s region is eight times its local memory).

/// Copies of one page a table can record (`mirror:8` at most).
pub const COPIES_MAX: usize = 8;
/// A holder slot with no server (slots hold the server's index plus one).
const NONE: u16 = 0;

#[derive(Debug, Clone, Copy, PartialEq, Eq, bytemuck::Zeroable)]
pub struct Entry {
    /// Incremented on every write-out (Nswap's version count); 0 before the first.
    pub version: u32,
    /// The page has been written: before that it reads as zeros without any I/O.
    pub present: bool,
    /// The local disk holds the current version (spilled, `disk` or `cluster+disk` backing).
    pub on_disk: bool,
    /// The holders' copies are gone (their server came back empty): reads fail as lost until
    /// the page is written again. The holder is kept to name it in the error.
    pub lost: bool,
}

impl Entry {
    const EMPTY: Entry = Entry {
        version: 0,
        present: false,
        on_disk: false,
        lost: false,
    };

    /// Advances the version for a new write-out; versions never go back, even across discards,
    /// so a copy left behind somewhere can never pass for the current one.
    pub fn next_version(&mut self) -> u32 {
        self.version = self
            .version
            .checked_add(1)
            .expect("2^32 write-outs of one page");
        self.version
    }
}

/// A small set of servers (the holders of a page, the targets of a write-back), by index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Servers {
    ids: [u16; COPIES_MAX],
    n: u8,
}

impl Servers {
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.ids[..self.n as usize].iter().map(|&s| usize::from(s))
    }
    pub fn len(&self) -> usize {
        self.n as usize
    }
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }
    pub fn contains(&self, s: usize) -> bool {
        self.iter().any(|x| x == s)
    }
    pub fn first(&self) -> Option<usize> {
        self.iter().next()
    }
    /// Adds a server (once); false when the set is full.
    pub fn insert(&mut self, s: usize) -> bool {
        assert!(
            s < usize::from(u16::MAX),
            "server index {s} does not fit the table"
        );
        if self.contains(s) {
            return true;
        }
        if self.len() == COPIES_MAX {
            return false;
        }
        self.ids[self.n as usize] = s as u16;
        self.n += 1;
        true
    }
    pub fn remove(&mut self, s: usize) -> bool {
        let at = self.iter().position(|x| x == s);
        match at {
            Some(i) => {
                self.ids.copy_within(i + 1..self.n as usize, i);
                self.n -= 1;
                true
            }
            None => false,
        }
    }
    pub fn to_vec(self) -> Vec<usize> {
        self.iter().collect()
    }
}

impl FromIterator<usize> for Servers {
    fn from_iter<I: IntoIterator<Item = usize>>(it: I) -> Self {
        let mut s = Servers::default();
        for x in it {
            s.insert(x);
        }
        s
    }
}

#[derive(Debug)]
pub struct Table {
    entries: Vec<Entry>,
    /// `copies` slots per page: a holder's index plus one, unused ones `NONE`.
    holders: Vec<u16>,
    copies: usize,
}

impl Table {
    pub fn new(pages: u64, copies: usize) -> Self {
        assert!((1..=COPIES_MAX).contains(&copies));
        let n = usize::try_from(pages).expect("page count fits in memory");
        Self {
            entries: bytemuck::zeroed_vec(n),
            holders: vec![NONE; n * copies],
            copies,
        }
    }

    pub fn get(&self, page: u64) -> &Entry {
        &self.entries[page as usize]
    }

    pub fn get_mut(&mut self, page: u64) -> &mut Entry {
        &mut self.entries[page as usize]
    }

    fn slots(&self, page: u64) -> &[u16] {
        let at = page as usize * self.copies;
        &self.holders[at..at + self.copies]
    }

    pub fn holders(&self, page: u64) -> Servers {
        self.slots(page)
            .iter()
            .filter(|&&h| h != NONE)
            .map(|&h| usize::from(h) - 1)
            .collect()
    }

    /// Makes `servers` the holders of the current version (none: on disk only, or lost).
    pub fn set_holders(&mut self, page: u64, servers: Servers) {
        assert!(servers.len() <= self.copies, "more holders than copies");
        let at = page as usize * self.copies;
        let slots = &mut self.holders[at..at + self.copies];
        slots.fill(NONE);
        for (slot, s) in slots.iter_mut().zip(servers.iter()) {
            *slot = s as u16 + 1;
        }
        self.entries[page as usize].lost = false;
    }

    /// The page was discarded: it reads as zeros again. The version is kept.
    pub fn forget(&mut self, page: u64) {
        let version = self.entries[page as usize].version;
        self.entries[page as usize] = Entry {
            version,
            ..Entry::EMPTY
        };
        self.set_holders(page, Servers::default());
    }

    /// Pages with a holder on `server`.
    pub fn pages_on(&self, server: usize) -> Vec<u64> {
        let s = server as u16 + 1;
        self.holders
            .chunks_exact(self.copies)
            .enumerate()
            .filter(|(_, h)| h.contains(&s))
            .map(|(p, _)| p as u64)
            .collect()
    }

    pub fn pages_per_server(&self, servers: usize) -> Vec<u64> {
        let mut n = vec![0u64; servers];
        for (e, h) in self
            .entries
            .iter()
            .zip(self.holders.chunks_exact(self.copies))
        {
            if e.lost {
                continue;
            }
            for &s in h.iter().filter(|&&s| s != NONE) {
                n[usize::from(s) - 1] += 1;
            }
        }
        n
    }

    pub fn pages_on_disk_only(&self) -> u64 {
        (0..self.entries.len() as u64)
            .filter(|&p| {
                let e = self.get(p);
                e.present && e.on_disk && self.holders(p).is_empty()
            })
            .count() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zeroed_table_is_empty() {
        assert_eq!(Entry::EMPTY, bytemuck::Zeroable::zeroed());
        let t = Table::new(4, 2);
        assert!((0..4).all(|p| *t.get(p) == Entry::EMPTY && t.holders(p).is_empty()));
    }

    #[test]
    fn entry_is_small_and_versions_only_grow() {
        assert_eq!(std::mem::size_of::<Entry>(), 8);
        let mut t = Table::new(4, 2);
        let e = t.get_mut(1);
        assert_eq!(e.next_version(), 1);
        e.present = true;
        t.set_holders(1, [3, 5].into_iter().collect());
        assert_eq!(t.holders(1).to_vec(), vec![3, 5]);
        assert_eq!(t.pages_on(5), vec![1]);
        t.forget(1);
        assert!(!t.get(1).present && t.holders(1).is_empty());
        assert_eq!(t.get_mut(1).next_version(), 2);
    }

    #[test]
    fn server_sets_keep_order_and_refuse_overflow() {
        let mut s: Servers = (0..COPIES_MAX).collect();
        assert!(!s.insert(99));
        assert!(s.insert(3), "already there");
        assert!(s.remove(0) && !s.remove(0));
        assert_eq!(s.first(), Some(1));
        assert_eq!(s.len(), COPIES_MAX - 1);
    }
}
