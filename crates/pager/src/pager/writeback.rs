//! Write-back (Anemone's write-back cache, paper 001 §2.1; Markatos' disk when the cluster is
//! full, paper 003 §2): a page leaving the cache keeps its slot until every copy or piece its
//! scheme sends is acknowledged; the page table then learns where it is. A page the local disk
//! fails to write stays in memory, dirty, and is written again later.

use crate::scheme::Landed;
use crate::table::Servers;
use crate::{Backing, Disk, Pager, PagerError, Transport};
use netram_proto::PAGE_SIZE;

/// A page being written out: its data stays in `slot` until every copy is settled.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Writeback {
    pub(crate) slot: u32,
    pub(crate) version: u32,
    /// Copies acknowledged.
    pub(crate) done: Servers,
    /// PUTs in flight.
    pub(crate) pending: Servers,
    /// Servers that refused the page or failed while storing it.
    pub(crate) refused: Servers,
    /// Holders whose copy of this very version stays valid (recovery adds copies to them).
    pub(crate) keep: Servers,
    /// A recovery's write: counted as a rebuilt page when whole.
    pub(crate) rebuild: bool,
    /// For a recovery's write, servers revived before it began: one revived since did not
    /// see this page short of copies, so a write that ends short goes back to recovery.
    pub(crate) revivals: u64,
    /// Under parity: the page joins a new group even where it is (its old one is gone).
    pub(crate) join: bool,
}

impl Writeback {
    /// The write-back of `version` from `slot`, nothing sent yet.
    pub(crate) fn new(slot: u32, version: u32) -> Self {
        Self {
            slot,
            version,
            done: Servers::default(),
            pending: Servers::default(),
            refused: Servers::default(),
            keep: Servers::default(),
            rebuild: false,
            revivals: 0,
            join: false,
        }
    }
}

impl<T: Transport, D: Disk> Pager<T, D> {
    /// Sends a page to its backing. The slot is released when the write is acknowledged.
    pub(crate) fn write_back(&mut self, page: u64, slot: u32) -> Result<(), PagerError> {
        self.write_back_avoiding(page, slot, None, false)
    }

    /// [`Pager::write_back`], keeping the page off server `avoid` (it is leaving it,
    /// `migrate.rs`) even where it would stay in place; under parity, `join` makes it join a
    /// new group even where it stays (its old group's holder is leaving).
    pub(crate) fn write_back_avoiding(
        &mut self,
        page: u64,
        slot: u32,
        avoid: Option<usize>,
        join: bool,
    ) -> Result<(), PagerError> {
        // One write-back per page at a time, so that versions land in order.
        let cached_before = self.cache.contains(&page);
        self.wait_writeback(page)?;
        if self.rehomed.remove(&page) && !cached_before {
            // The write-back waited for failed and came back to the cache: this write is newer.
            if let Some(stale) = self.cache.pop(&page) {
                self.release_slot(stale);
            }
        }
        if self.cfg.backing != Backing::Cluster && !self.write_to_disk(page, slot) {
            // A failed write may have torn the disk's copy: the page lives in memory until a
            // write succeeds, and the version stays, so remote copies of it remain valid.
            self.table.get_mut(page).on_disk = false;
            self.rehome(page, slot);
            return Ok(());
        }
        let version = self.table.get_mut(page).next_version();
        let e = self.table.get_mut(page);
        e.present = true;
        e.on_disk = self.cfg.backing != Backing::Cluster;
        if self.cfg.backing == Backing::Disk {
            self.release_slot(slot);
            return Ok(());
        }
        let mut wb = Writeback {
            join,
            ..Writeback::new(slot, version)
        };
        if let Some(s) = avoid {
            wb.refused.insert(s);
        }
        self.begin_writeback(page, wb);
        self.written_back(page)
    }

    /// Writes a slot to the local disk. A failure is counted, logged and kept for the next
    /// `flush` to report; the caller keeps the page in memory ([`Pager::rehome`]).
    pub(crate) fn write_to_disk(&mut self, page: u64, slot: u32) -> bool {
        self.counters.disk_writes += 1;
        let at = slot as usize * PAGE_SIZE;
        match self.disk.write(page, &self.slots[at..at + PAGE_SIZE]) {
            Ok(()) => true,
            Err(e) => {
                self.counters.disk_write_errors += 1;
                tracing::error!(page, "local disk write failed, page kept in memory: {e}");
                self.disk_failed = Some(e);
                false
            }
        }
    }

    /// A page whose write-back found no home (the local disk failed it) goes back to the
    /// cache, dirty, so that nothing is lost: it is written again at its next eviction or
    /// flush. A newer version cached meanwhile wins.
    pub(crate) fn rehome(&mut self, page: u64, slot: u32) {
        // A move that ends here did not land: the page is dirty in memory again.
        self.migrating.remove(&page);
        self.rehomed.insert(page);
        match self.cache.peek(&page) {
            Some(&cached) => {
                self.dirty[cached as usize] = true;
                self.release_slot(slot);
            }
            None => {
                self.cache.put(page, slot);
                self.dirty[slot as usize] = true;
            }
        }
    }

    /// A page that `server` refused or will never acknowledge: placed elsewhere if possible.
    pub(crate) fn copy_failed(&mut self, page: u64, server: usize) -> Result<(), PagerError> {
        let Some(wb) = self.writeback.get_mut(&page) else {
            return Ok(());
        };
        wb.pending.remove(server);
        wb.refused.insert(server);
        self.place(page)
    }

    /// Every copy of a write-back is acknowledged or failed: the page table learns where the
    /// page is now, superseded copies are deleted and the slot is freed. No copy at all: the
    /// page goes to the local disk (Markatos: the disk when the cluster is full).
    pub(crate) fn finish_writeback(&mut self, page: u64) -> Result<(), PagerError> {
        let wb = self.writeback.remove(&page).expect("page in write-back");
        // A copy acknowledged by a server that has died since does not count.
        let holders: Servers = wb
            .keep
            .iter()
            .chain(wb.done.iter())
            .filter(|&s| self.servers[s].alive)
            .collect();
        let landed = if holders.len() < self.shape.copies {
            // Too few servers alive or with room for every copy: the local disk makes up
            // for the missing ones (Markatos: the disk when the cluster is full). Recovery
            // adds the missing copies when servers come back.
            if !self.table.get(page).on_disk {
                self.counters.spills += 1;
                // The disk (and the cache, should it fail) hold plaintext.
                self.unseal_own(page, wb.version, wb.slot);
                if !self.write_to_disk(page, wb.slot) {
                    // Fewer copies than promised and no disk to make up for them: the copies
                    // made count, and the page stays in memory until it is written again.
                    self.copies_landed(page, Landed::InMemory);
                    self.set_location(page, holders);
                    self.table.get_mut(page).on_disk = false;
                    self.rehome(page, wb.slot);
                    return Ok(());
                }
                self.table.get_mut(page).on_disk = true;
            }
            if holders.is_empty() {
                Landed::OnDiskOnly
            } else if wb.rebuild {
                // A server that came back while this copy was out found the page not yet
                // short: recovery tries again now rather than at the next revival.
                Landed::Short {
                    rebuilt: wb.revivals == self.counters.servers_revived,
                }
            } else {
                self.counters.writes_degraded += 1;
                Landed::Short { rebuilt: false }
            }
        } else {
            if wb.rebuild {
                self.counters.pages_rebuilt += 1;
            }
            Landed::Enough
        };
        self.copies_landed(page, landed);
        self.landed(page, holders.is_empty());
        self.set_location(page, holders);
        self.release_slot(wb.slot);
        Ok(())
    }

    /// Records where the current version of a page lives; deletes superseded remote copies.
    pub(crate) fn set_location(&mut self, page: u64, holders: Servers) {
        for s in self.table.holders(page).iter() {
            if !holders.contains(s) && self.servers[s].alive {
                self.counters.deletes += 1;
                self.delete(s, vec![self.key(page)]);
            }
        }
        self.table.set_holders(page, holders);
        if holders.is_empty() {
            self.table.get_mut(page).on_disk = true;
        }
    }

    pub(crate) fn wait_writeback(&mut self, page: u64) -> Result<(), PagerError> {
        while self.writeback.contains_key(&page) {
            // Its stripe or group may not be sealed, and so nothing be in flight for it yet: it
            // goes now, full or not (checked each time: a page may join a group while it
            // waits).
            self.seal_open(Some(page))?;
            // Nothing under way can finish it: a bookkeeping slip, which must not spin forever.
            assert!(
                !(self.idle() && self.writeback.contains_key(&page)),
                "page {page} waits in write-back with nothing in flight to finish it"
            );
            self.complete_one()?;
        }
        Ok(())
    }
}
