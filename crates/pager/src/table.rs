//! The page table: for every page of the region, where its current version lives.
//!
//! An entry is 12 bytes, so that a 64 GiB device (16 M pages) needs 192 MiB of table rather
//! than a map with a heap node per page. It has room for [`HOLDERS_MAX`] servers per page, which
//! mirroring (a later issue) fills; today one holder is set at a time.

/// Servers that may hold copies of one page.
pub const HOLDERS_MAX: usize = 2;
const NONE: u16 = u16::MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// Incremented on every write-out (Nswap's version count); 0 before the first.
    pub version: u32,
    holders: [u16; HOLDERS_MAX],
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
        holders: [NONE; HOLDERS_MAX],
        present: false,
        on_disk: false,
        lost: false,
    };

    pub fn holders(&self) -> impl Iterator<Item = usize> + '_ {
        self.holders
            .iter()
            .filter(|&&h| h != NONE)
            .map(|&h| usize::from(h))
    }

    /// Makes `server` the only holder of the current version.
    pub fn set_holder(&mut self, server: usize) {
        assert!(
            server < usize::from(NONE),
            "server index {server} does not fit the table"
        );
        self.holders = [NONE; HOLDERS_MAX];
        self.holders[0] = server as u16;
        self.lost = false;
    }

    pub fn clear_holders(&mut self) {
        self.holders = [NONE; HOLDERS_MAX];
        self.lost = false;
    }

    /// Advances the version for a new write-out; versions never go back, even across discards,
    /// so a copy left behind somewhere can never pass for the current one.
    pub fn next_version(&mut self) -> u32 {
        self.version = self
            .version
            .checked_add(1)
            .expect("2^32 write-outs of one page");
        self.version
    }

    /// The page was discarded: it reads as zeros again. The version is kept.
    pub fn forget(&mut self) {
        *self = Entry {
            version: self.version,
            ..Entry::EMPTY
        };
    }
}

#[derive(Debug)]
pub struct Table {
    entries: Vec<Entry>,
}

impl Table {
    pub fn new(pages: u64) -> Self {
        let n = usize::try_from(pages).expect("page count fits in memory");
        Self {
            entries: vec![Entry::EMPTY; n],
        }
    }

    pub fn get(&self, page: u64) -> &Entry {
        &self.entries[page as usize]
    }

    pub fn get_mut(&mut self, page: u64) -> &mut Entry {
        &mut self.entries[page as usize]
    }

    /// Every entry, by page number.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (u64, &mut Entry)> {
        self.entries
            .iter_mut()
            .enumerate()
            .map(|(i, e)| (i as u64, e))
    }

    pub fn pages_per_server(&self, servers: usize) -> Vec<u64> {
        let mut n = vec![0u64; servers];
        for e in self.entries.iter().filter(|e| !e.lost) {
            for s in e.holders() {
                n[s] += 1;
            }
        }
        n
    }

    pub fn pages_on_disk_only(&self) -> u64 {
        self.entries
            .iter()
            .filter(|e| e.present && e.on_disk && e.holders().next().is_none())
            .count() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_is_small_and_versions_only_grow() {
        assert_eq!(std::mem::size_of::<Entry>(), 12);
        let mut t = Table::new(4);
        let e = t.get_mut(1);
        assert_eq!(e.next_version(), 1);
        e.present = true;
        e.set_holder(3);
        assert_eq!(e.holders().collect::<Vec<_>>(), vec![3]);
        e.forget();
        assert!(!e.present && e.holders().next().is_none());
        assert_eq!(e.next_version(), 2);
    }
}
