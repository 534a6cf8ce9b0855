//! Making room: victims named by the clock (first in, first out, or CLOCK over sampled pages,
//! GMS §4.2), write-protected, copied to the pager and dropped in batches; pages the program
//! releases. Anemone §2.1's page-out, from user space.

use super::*;

impl<T: Transport, D: Disk> Shared<T, D> {
    /// Evicts until at most `keep` pages are resident, sampling on the way.
    ///
    /// Victims go in batches, in three steps: chosen, write-protected, then copied out, stored
    /// and dropped. Every change to the program's page tables costs a TLB shootdown (an
    /// interrupt to each other CPU running the program, a VM exit on a virtual machine), so
    /// the dirty victims of a batch that are consecutive pages are write-protected with one
    /// call, and the pages of a batch leave with one `process_madvise` call, which the kernel
    /// (6.16 on) flushes once. A victim chosen but not dropped yet stays mapped
    /// write-protected (or aside, if sampled): a write to it blocks until the batch is gone
    /// and then faults it back in.
    ///
    /// Nothing here waits for the network: a dirty victim is written only if the pager takes
    /// it at once ([`Pager::try_write`]), so a batch holds at most as many dirty victims as
    /// the pager has room for, and the rest stay resident, over the budget, until replies
    /// return slots (read here, and by the handler's loop, which waits on them while the
    /// region is over its budget). Past [`OVER_BUDGET`] pages over, victims wait for room as
    /// they always did: the servers are behind, and the program's memory must not grow with
    /// them; but not on the handler's thread while acknowledgements are awaited, which
    /// instead holds new faults until they return room (`holds_faults`), so that it never
    /// waits. Forked children change nothing here: what they still read of the dirty victims
    /// is read for them by ticket first (`settle_ahead`).
    pub(crate) fn make_room(&self, st: &mut State<T, D>, keep: usize) {
        if st.clock.len() <= keep || st.forking > 0 {
            // While a fork is pending nothing leaves: the child gets every page resident at
            // its announcement (see `prepare_fork`). The budget is caught up with afterwards.
            return;
        }
        // A batch small next to the budget, so that residency stays close to it.
        let batch = (st.budget / 16).clamp(1, EVICT_BATCH);
        let target = keep.saturating_sub(batch - 1);
        let wait = st.clock.len() > keep + OVER_BUDGET
            && !(handler::on_handler() && st.pager.awaits_replies());
        let mut room = usize::MAX;
        if !wait {
            room = st.pager.write_room();
            if room < batch {
                // Slots come back with the acknowledgements that have arrived.
                if let Err(e) = st.pager.poll() {
                    tracing::debug!("while making room: {e}");
                }
                room = st.pager.write_room();
            }
            if room == 0 {
                self.counters
                    .evictions_deferred
                    .fetch_add(1, Ordering::Relaxed);
                return;
            }
        } else {
            self.counters
                .evictions_waited
                .fetch_add(1, Ordering::Relaxed);
        }
        let mut chosen = std::mem::take(&mut st.victims);
        chosen.clear();
        while st.clock.len() > target && room > 0 {
            let Some(victim) = st.clock.victim() else {
                break;
            };
            if st.dirty[victim.page as usize] {
                // A page of zeros is discarded rather than written, but which is which shows
                // only once it is copied out.
                room -= 1;
            }
            for &p in &victim.sample {
                match self.sample(p as usize) {
                    Ok(()) => {
                        self.counters.samples.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        self.counters
                            .sample_failures
                            .fetch_add(1, Ordering::Relaxed);
                        tracing::debug!("sampling page {p}: {e}");
                        st.clock.unsample(p);
                    }
                }
            }
            chosen.push((victim.page as usize, victim.sampled));
        }
        self.protect_victims(st, &mut chosen);
        if !st.children.is_empty() {
            // What the children still read of the dirty victims is read first: by ticket,
            // those victims waiting resident for it, or else in one go (each victim's
            // write-back would otherwise read its page for them first, in turn).
            self.settle_ahead(st, &mut chosen);
        }
        let mut drops = std::mem::take(&mut st.drops);
        let mut failed = false;
        for &(page, sampled) in &chosen {
            let evicted = if sampled {
                self.evict_sampled(st, page, wait)
                    .map(|a| a.map(|a| (page, a as usize, false)))
            } else {
                self.evict_mapped(st, page, wait)
                    .map(|a| a.map(|a| (page, a as usize, true)))
            };
            match evicted {
                Ok(Some(d)) => drops.push(d),
                // Unreadable, or the pager had no room for it after all: kept (at the back
                // of the ring).
                Ok(None) => {}
                // The page stays resident (see `evict_mapped`); the rest of the batch is
                // tried, as it is already write-protected, and the first failure logged.
                Err(e) => {
                    self.counters.errors.fetch_add(1, Ordering::Relaxed);
                    if !failed {
                        tracing::error!("evicting a page: {e}");
                    }
                    failed = true;
                }
            }
        }
        // The batch's write-backs leave together, in full frames.
        st.pager.send_queued();
        self.drop_batch(st, &drops);
        drops.clear();
        st.drops = drops;
        st.victims = chosen;
    }

    /// Whether the handler holds new faults rather than serve them: the region more than
    /// [`OVER_BUDGET`] pages over its budget, with acknowledgements on their way to return
    /// the room its victims wait for (see `make_room`). Not while a fork is pending (nothing
    /// is evicted then: the fork's own deferral applies).
    pub(crate) fn holds_faults(&self, st: &State<T, D>) -> bool {
        st.forking == 0 && st.clock.len() > st.budget + OVER_BUDGET && st.pager.awaits_replies()
    }

    /// Write-protects the chosen victims that are mapped and dirty, each run of consecutive
    /// pages with one call; the pages of a run that cannot be protected stay resident and
    /// leave the batch.
    fn protect_victims(&self, st: &mut State<T, D>, chosen: &mut Vec<(usize, bool)>) {
        let mut dirty: Vec<usize> = chosen
            .iter()
            .filter(|&&(page, sampled)| !sampled && st.dirty[page])
            .map(|&(page, _)| page)
            .collect();
        dirty.sort_unstable();
        let mut kept = Vec::new();
        for run in dirty.chunk_by(|a, b| b - a == 1) {
            let addr = self.base.page(run[0]);
            self.counters
                .write_protect_calls
                .fetch_add(1, Ordering::Relaxed);
            if let Err(errno) = self
                .uffd
                .set_write_protect_range(addr, run.len(), true, true)
            {
                if errno == rustix::io::Errno::AGAIN {
                    // The mapping is changing (a fork copying it, announced or not, until
                    // the handler reads its event): not an error; a later batch tries again.
                    self.counters
                        .retried
                        .fetch_add(run.len() as u64, Ordering::Relaxed);
                } else {
                    self.counters
                        .errors
                        .fetch_add(run.len() as u64, Ordering::Relaxed);
                    let e = PageError::WriteProtect {
                        page: run[0],
                        errno,
                    };
                    tracing::error!("evicting {} pages: {e}", run.len());
                }
                for &page in run {
                    st.clock.insert(page as u64);
                    kept.push(page);
                }
            }
        }
        if !kept.is_empty() {
            chosen.retain(|(page, _)| !kept.contains(page));
        }
    }

    /// Drops the chosen victims' memory: `(page, address, whether in the region)`.
    pub(crate) fn drop_batch(&self, st: &mut State<T, D>, drops: &[(usize, usize, bool)]) {
        if drops.is_empty() {
            return;
        }
        if let Some(pidfd) = &self.pidfd {
            let iov: Vec<libc::iovec> = drops
                .iter()
                .map(|&(_, addr, _)| libc::iovec {
                    iov_base: addr as *mut c_void,
                    iov_len: PAGE_SIZE,
                })
                .collect();
            use std::os::fd::AsRawFd;
            // SAFETY: process_madvise(2) on this process's own pages, which are either stored
            // or unchanged since fetched (see `drop_pages`); the iovecs are valid for the call.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_process_madvise,
                    pidfd.as_raw_fd(),
                    iov.as_ptr(),
                    iov.len(),
                    libc::MADV_DONTNEED,
                    0,
                )
            };
            if r == (drops.len() * PAGE_SIZE) as libc::c_long {
                return;
            }
            // Refused (an older kernel) or cut short: the rest page by page; dropping a page
            // twice is harmless.
        }
        for &(page, addr, in_region) in drops {
            let addr = addr as *mut c_void;
            if let Err(e) = drop_pages(addr, PAGE_SIZE) {
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                tracing::error!("dropping page {page}: {e}");
                if in_region {
                    // Still mapped and write-protected: resident again, and taken as dirty
                    // (its copy may have gone to the pager, or not).
                    st.dirty[page] = true;
                    st.clock.insert(page as u64);
                    let _ = self.uffd.set_write_protect(addr, false, true);
                }
            }
        }
    }

    /// Takes `page` out of the program's page tables, keeping it aside: its next access
    /// faults, which tells the clock that it is in use.
    pub(crate) fn sample(&self, page: usize) -> Result<(), rustix::io::Errno> {
        let shadow = self.shadow.expect("sampling only with a shadow");
        self.uffd.move_page(self.base.page(page), shadow.page(page))
    }

    /// Evicts a sampled page: it is aside, out of reach of the program, so it is copied and
    /// stored without any write-protection; the caller drops it. On failure, or when the
    /// pager cannot take it without waiting and `wait` is false (`None`), it goes back into
    /// the region.
    pub(crate) fn evict_sampled(
        &self,
        st: &mut State<T, D>,
        page: usize,
        wait: bool,
    ) -> Result<Option<*mut c_void>, PageError> {
        let aside = self
            .shadow
            .expect("sampled pages live in the shadow")
            .page(page);
        if st.dirty[page] {
            // SAFETY: a sampled page is present in the shadow, touched only by this handler.
            unsafe {
                std::ptr::copy_nonoverlapping(aside.cast::<u8>(), st.buf.as_mut_ptr(), PAGE_SIZE)
            };
            let stored = self.store(st, page, wait);
            if !matches!(stored, Ok(true)) {
                if let Err(e) = self.uffd.move_page(aside, self.base.page(page)) {
                    tracing::error!("page {page} could not be put back after a failed store: {e}");
                }
                st.clock.insert(page as u64);
                return match stored {
                    Err(source) => Err(PageError::Store { page, source }),
                    Ok(_) => Ok(None),
                };
            }
        } else {
            self.counters.evicted_clean.fetch_add(1, Ordering::Relaxed);
        }
        st.dirty[page] = false;
        self.counters.evictions.fetch_add(1, Ordering::Relaxed);
        Ok(Some(aside))
    }

    /// Stores the page in `st.buf` as page `page` (an all-zero page is discarded instead);
    /// false if `wait` is false and the pager cannot take it without waiting (nothing done).
    pub(crate) fn store(
        &self,
        st: &mut State<T, D>,
        page: usize,
        wait: bool,
    ) -> Result<bool, netram_pager::PagerError> {
        let zeros = st.buf.iter().all(|&b| b == 0);
        if st.released.contains(&(page as u64)) {
            if zeros {
                // Given back while its write-back was out, and still zeros: the delete to
                // come takes the old copy away, which is all a page of zeros needs.
                self.counters.evicted_zero.fetch_add(1, Ordering::Relaxed);
                return Ok(true);
            }
            // Written again since: children forked meanwhile read it as zeros, kept so for
            // them (while it still counts as never written) before the new contents supersede
            // the old copy, which must no longer be deleted after them.
            self.settle_from(st, page, Some(&ZEROS));
            st.released.remove(&(page as u64));
        }
        // What a forked child still reads of it is kept for it first: `settle_ahead` has read
        // the dirty victims' copies for them by ticket (or the waiting way), so this finds
        // nothing left. Kept for them even if the page then stays (no room): a copy they hold
        // is as good as the one they read.
        self.settle(st, page);
        let stored = if wait {
            if zeros {
                st.pager.discard(page as u64)
            } else {
                st.pager.write(page as u64, &st.buf)
            }
            .map(|()| true)
        } else {
            if zeros {
                st.pager.try_discard(page as u64)
            } else {
                st.pager.try_write(page as u64, &st.buf)
            }
        };
        match stored {
            Ok(true) if zeros => {
                self.counters.evicted_zero.fetch_add(1, Ordering::Relaxed);
            }
            Ok(false) => {
                self.counters.victims_kept.fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
        stored
    }

    /// Evicts a page still mapped, write-protected by `protect_victims` if dirty: copy out,
    /// store; the caller drops it. On failure the page stays resident and writable; `None`
    /// (kept, resident, nothing counted as an error) if the program has made it unreadable.
    pub(crate) fn evict_mapped(
        &self,
        st: &mut State<T, D>,
        page: usize,
        wait: bool,
    ) -> Result<Option<*mut c_void>, PageError> {
        let addr = self.base.page(page);
        if !st.dirty[page] {
            // Fetched and never written since: its remote copy is current, and it is still
            // write-protected, so no write can slip in before it is dropped.
            self.counters.evictions.fetch_add(1, Ordering::Relaxed);
            self.counters.evicted_clean.fetch_add(1, Ordering::Relaxed);
            return Ok(Some(addr));
        }
        // Write-protected (`protect_victims`): a write from now on blocks in a write-protect
        // fault until the page is gone.
        let copied = if self.unreadable_possible.load(Ordering::Relaxed) {
            let mut buf = std::mem::take(&mut st.buf);
            let copied = self.copy_out(addr, &mut buf);
            st.buf = buf;
            copied
        } else {
            // SAFETY: the page is mapped (resident), readable (the program has not said
            // otherwise) and write-protected: no thread changes it while it is copied.
            unsafe {
                std::ptr::copy_nonoverlapping(addr.cast::<u8>(), st.buf.as_mut_ptr(), PAGE_SIZE)
            };
            Ok(())
        };
        match copied {
            Ok(()) => {}
            Err(rustix::io::Errno::FAULT) => {
                // `mprotect(PROT_NONE)` by the program: kept as it is, dirty, writable
                // again (for when the program lifts the protection).
                let _ = self.uffd.set_write_protect(addr, false, true);
                st.clock.insert(page as u64);
                self.counters
                    .unreadable_victims
                    .fetch_add(1, Ordering::Relaxed);
                return Ok(None);
            }
            Err(errno) => {
                let _ = self.uffd.set_write_protect(addr, false, true);
                st.clock.insert(page as u64);
                return Err(PageError::Copy { page, errno });
            }
        }
        let stored = self.store(st, page, wait);
        if !matches!(stored, Ok(true)) {
            // Keep the page: writable again, and the writers blocked on it woken.
            let _ = self.uffd.set_write_protect(addr, false, true);
            st.clock.insert(page as u64);
            return match stored {
                Err(source) => Err(PageError::Store { page, source }),
                // The pager had no room for it after all (its last write-back is still out):
                // it stays, dirty, for a later batch.
                Ok(_) => Ok(None),
            };
        }
        st.dirty[page] = false;
        self.counters.evictions.fetch_add(1, Ordering::Relaxed);
        Ok(Some(addr))
    }

    /// Copies the resident page at `addr` into `buf` through the kernel (`process_vm_readv`
    /// on this process), not with a plain load: the program may have made the page
    /// unreadable (`mprotect(PROT_NONE)` on its own memory: guard pages, a runtime's
    /// protected heap), and a plain load would kill the process with SIGSEGV in this thread.
    /// The kernel reports EFAULT instead. It costs a system call per page (GNU sort at 12M
    /// local took 5 % longer with every victim copied this way), so only once the program
    /// may have protected pages.
    pub(crate) fn copy_out(
        &self,
        addr: *mut c_void,
        buf: &mut [u8],
    ) -> Result<(), rustix::io::Errno> {
        let local = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: PAGE_SIZE,
        };
        let remote = libc::iovec {
            iov_base: addr,
            iov_len: PAGE_SIZE,
        };
        // SAFETY: reads one page of this process into `buf`, which is PAGE_SIZE bytes; the
        // kernel checks the source's mapping and protection and fails rather than fault.
        let n = unsafe { libc::process_vm_readv(self.pid, &local, 1, &remote, 1, 0) };
        match n {
            n if n == PAGE_SIZE as isize => Ok(()),
            n if n >= 0 => Err(rustix::io::Errno::FAULT),
            _ => Err(rustix::io::Errno::from_raw_os_error(
                std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
            )),
        }
    }

    /// A page given back (or dropped by the program) whose last write-back is still out:
    /// its pager copy is deleted once that is in (`delete_leftovers`), and it counts as never
    /// written meanwhile ([`State::holds`]). Nothing waits.
    pub(crate) fn defer_delete(&self, st: &mut State<T, D>, page: u64) {
        st.released.insert(page);
        self.counters
            .releases_deferred
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Pages `first..first + count` are given back by the program (see `Region::release`).
    pub(crate) fn release(
        &self,
        st: &mut State<T, D>,
        first: usize,
        count: usize,
    ) -> Result<(), PageError> {
        // One call drops every mapped page of the range (and the zero page's mappings).
        drop_pages(self.base.page(first), count * PAGE_SIZE).map_err(PageError::Drop)?;
        let mut written = Vec::new();
        let mut deferred = false;
        if !st.children.is_empty() {
            let pages: Vec<usize> = (first..first + count).collect();
            let now = self.settle_released(st, &pages);
            self.settle_many(st, &now);
        }
        for page in first..first + count {
            let p = page as u64;
            if st.clock.is_sampled(p) {
                let aside = self.shadow.expect("sampled pages live in the shadow");
                let _ = drop_pages(aside.page(page), PAGE_SIZE);
            }
            st.clock.remove(p);
            st.dirty[page] = false;
            st.prefetched.remove(&p);
            if let Some(f) = st.fetching.get_mut(&p) {
                // On its way: what arrives is the old contents, not to be installed.
                f.released = true;
            }
            if st.release_settling.contains(&p) {
                // Read for the children by ticket (`settle_released`): deleted once it is in.
                st.released.insert(p);
                deferred = true;
                continue;
            }
            if st.holds(p) {
                self.settle(st, page);
                written.push(p);
            }
        }
        self.counters
            .released
            .fetch_add(count as u64, Ordering::Relaxed);
        // Forgotten at once, their DELETEs sent as credits allow (never waited for: a
        // connection applies its requests in order, so a later PUT of a page lands after its
        // DELETE).
        for p in written {
            if !st.pager.try_discard(p).map_err(PageError::Delete)? {
                // Its last write-back is still out: deleted once it is in (reading as zeros
                // meanwhile), so that the acknowledgement does not bring the page back.
                self.defer_delete(st, p);
                deferred = true;
            }
        }
        st.pager.send_queued();
        if deferred {
            // The handler's loop deletes them, and may be asleep without a deadline (this
            // runs on the program's thread).
            let _ = rustix::io::write(&*self.wake, &handler::WAKE.to_ne_bytes());
        }
        Ok(())
    }
}
