//! Serving one fault: a page fetched from the pager (or the zero page for one never written),
//! installed with `UFFDIO_COPY`; resident and sampled pages; a page that cannot be read (SIGBUS
//! to its thread). Anemone §2.2, GMS §4.2 (sampled references).

use super::*;

impl<T: Transport, D: Disk> Shared<T, D> {
    /// A missing-page fault on `page` by thread `tid`; `write`: the access was a write.
    pub(crate) fn missing(&self, st: &mut State<T, D>, page: usize, write: bool, tid: u32) {
        self.counters.faults.fetch_add(1, Ordering::Relaxed);
        self.serve_missing(st, page, write, tid);
    }

    /// [`Shared::missing`] of a fault already counted.
    pub(crate) fn serve_missing(&self, st: &mut State<T, D>, page: usize, write: bool, tid: u32) {
        let addr = self.base.page(page);
        if st.clock.is_sampled(page as u64) {
            return self.sampled_fault(st, page, write);
        }
        if st.clock.is_resident(page as u64) {
            return self.resident_fault(st, page);
        }
        if let Some(mode) = st.prefetched.remove(&(page as u64)) {
            // Fetched ahead: the pager serves it from its cache, without a round trip.
            self.counters.prefetch_hits.fetch_add(1, Ordering::Relaxed);
            st.prefetcher.hit(mode);
        }
        if st.holds(page as u64) {
            if st.forking > 0 && st.forking_tid != Some(tid) {
                // A fork is pending: the page is fetched once it has happened (a fetch
                // installed meanwhile would be in the parent and not in the child's share).
                // Not the forking thread's own fault: its fork waits for it (then the child
                // reads that page from the pager, as one not resident at the announcement).
                st.deferred.push((page, write, tid));
                self.counters
                    .faults_deferred
                    .fetch_add(1, Ordering::Relaxed);
                return;
            }
            // (Here only when the page was not fetchable as its event came: given back while
            // its fetch was out, deferred over a fork, or the forking thread's own.)
            return self.fetch_fault(st, page, write, tid);
        }
        self.counters.zero_fills.fetch_add(1, Ordering::Relaxed);
        let result = if write {
            // Written at once: a page of zeros, writable, rather than the shared zero page and
            // a copy-on-write fault right after.
            self.uffd.copy(&ZEROS, addr, false)
        } else {
            self.uffd.zeropage(addr)
        };
        match result {
            // A zero fill needs no tracking: the kernel maps the shared zero page, a write
            // replaces it, and eviction finds out by looking whether it is still all zeros.
            Ok(()) => {
                st.dirty[page] = true;
                st.clock.insert(page as u64);
            }
            Err(e) => {
                if !self.install_failed(st, page, e) {
                    return;
                }
            }
        }
        let keep = st.budget;
        self.make_room(st, keep);
        self.prefetch(st, page);
    }

    /// Serves the faults deferred over a fork, once none is pending, and those held past the
    /// budget, while room lasts (the handler's loop, each turn): each as its event would have
    /// been served now, in the order they came.
    pub(crate) fn serve_deferred(&self, st: &mut State<T, D>) {
        if st.forking > 0 || st.deferred.is_empty() {
            return;
        }
        let mut deferred = std::mem::take(&mut st.deferred);
        let mut served = 0;
        for &(page, write, tid) in &deferred {
            if self.holds_faults(st) {
                break;
            }
            served += 1;
            if self.fetchable(st, page) {
                self.fetch_fault(st, page, write, tid);
            } else {
                self.serve_missing(st, page, write, tid);
            }
        }
        deferred.drain(..served);
        // (Serving may have deferred more: those came after.)
        deferred.append(&mut st.deferred);
        st.deferred = deferred;
    }

    /// Installs a fetched page's `data` (waking the threads waiting on it) and makes it
    /// resident; false if it was not installed (already there, or the kernel refused: the
    /// woken thread faults again).
    pub(crate) fn install_fetched(
        &self,
        st: &mut State<T, D>,
        page: usize,
        write: bool,
        data: &[u8],
    ) -> bool {
        let addr = self.base.page(page);
        // A fetched page equals its remote copy until written: installed write-protected, its
        // first write is seen, and if there is none it is evicted without I/O. That costs a
        // second fault for every page that is written after all, so it is done only while it
        // pays: not for a write fault, and not while most fetched pages get written.
        let protect = !write && st.protection.decide();
        self.counters.fetches.fetch_add(1, Ordering::Relaxed);
        match self.uffd.copy(data, addr, protect) {
            Ok(()) => {
                // Only a protected page is known clean.
                st.dirty[page] = !protect;
                st.clock.insert(page as u64);
                true
            }
            Err(e) => self.install_failed(st, page, e),
        }
    }

    /// An install the kernel refused: the threads waiting on the page are woken; true if the
    /// page is resident all the same (installed meanwhile), false if they will fault again.
    pub(crate) fn install_failed(
        &self,
        st: &mut State<T, D>,
        page: usize,
        e: rustix::io::Errno,
    ) -> bool {
        let addr = self.base.page(page);
        match e {
            // Installed meanwhile (by a fault this handler has not read yet, or the program
            // wrote through a kernel path): present now, so resident.
            rustix::io::Errno::EXIST => {
                self.counters
                    .already_present
                    .fetch_add(1, Ordering::Relaxed);
                let _ = self.uffd.wake(addr, PAGE_SIZE);
                st.dirty[page] = true;
                st.clock.insert(page as u64);
                true
            }
            // The mapping is changing (a fork copying it): the woken thread faults again.
            rustix::io::Errno::AGAIN => {
                self.counters.retried.fetch_add(1, Ordering::Relaxed);
                let _ = self.uffd.wake(addr, PAGE_SIZE);
                false
            }
            e => {
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                tracing::debug!("installing page {page}: errno {e}");
                let _ = self.uffd.wake(addr, PAGE_SIZE);
                false
            }
        }
    }

    /// A missing fault on a page believed resident. Usually a second thread's fault on a page
    /// the first one's brought in (the event was queued before the install): only wake it.
    /// But the program may have dropped the page itself (`madvise(MADV_DONTNEED)` through a
    /// raw system call, unseen by `release`): the page then reads as zeros, as anonymous
    /// memory does, and its remote copy is stale. Installing zeros tells the two apart: the
    /// kernel refuses (EEXIST) if the page is there. Without this, the thread would fault
    /// forever on a page the handler believes present.
    pub(crate) fn resident_fault(&self, st: &mut State<T, D>, page: usize) {
        let addr = self.base.page(page);
        match self.uffd.zeropage(addr) {
            Ok(_) => {
                self.counters
                    .dropped_by_program
                    .fetch_add(1, Ordering::Relaxed);
                st.dirty[page] = true;
                if st.holds(page as u64) {
                    self.settle(st, page);
                    match st.pager.try_discard(page as u64) {
                        Ok(true) => {}
                        Ok(false) => self.defer_delete(st, page as u64),
                        Err(e) => tracing::warn!("deleting page {page} the program dropped: {e}"),
                    }
                }
            }
            Err(_) => {
                self.counters
                    .already_present
                    .fetch_add(1, Ordering::Relaxed);
                let _ = self.uffd.wake(addr, PAGE_SIZE);
            }
        }
    }

    /// A sampled page was touched: it was in use after all. Put it back where it was.
    pub(crate) fn sampled_fault(&self, st: &mut State<T, D>, page: usize, write: bool) {
        self.counters.sample_faults.fetch_add(1, Ordering::Relaxed);
        if write {
            // About to be written: back writable, dirty, without a write-protect fault.
            st.dirty[page] = true;
        }
        let shadow = self.shadow.expect("sampled pages live in the shadow");
        let (aside, addr) = (shadow.page(page), self.base.page(page));
        // SAFETY: a sampled page is present in the shadow, which nothing but this handler
        // touches, and this handler holds the state: the page does not change while read.
        let contents = unsafe { std::slice::from_raw_parts(aside.cast::<u8>(), PAGE_SIZE) };
        // Ok(true): copied back, and the copy aside is to be dropped.
        let back = if st.dirty[page] {
            // Moving it back maps it writable, as a dirty page should be.
            match self.uffd.move_page(aside, addr) {
                Ok(()) => {
                    let _ = self.uffd.wake(addr, PAGE_SIZE);
                    Ok(false)
                }
                Err(_) => self.uffd.copy(contents, addr, true).map(|()| true),
            }
        } else {
            // Moved back it would be writable, and a write by another thread before it was
            // protected again would go unseen: copy it back write-protected in one ioctl.
            self.uffd.copy(contents, addr, true).map(|()| true)
        };
        match back {
            Ok(copied) => {
                if copied {
                    let _ = drop_pages(aside, PAGE_SIZE);
                }
                st.clock.touched(page as u64);
            }
            // The mapping is changing (a fork copying it, announced or not): the page stays
            // aside, sampled, and the woken thread faults again, as for a fetched page's
            // install (`install_failed`). Not an error.
            Err(rustix::io::Errno::AGAIN) => {
                self.counters.retried.fetch_add(1, Ordering::Relaxed);
                let _ = self.uffd.wake(addr, PAGE_SIZE);
            }
            Err(e) => {
                // The page stays aside, sampled; the woken thread faults again.
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                tracing::error!("putting back sampled page {page}: {e}");
                let _ = self.uffd.wake(addr, PAGE_SIZE);
            }
        }
    }

    /// A page the pager cannot read: the pager has already tried every copy (other servers,
    /// parity, the disk), so waking the thread would only make it fault again, forever. It
    /// gets SIGBUS, as the kernel answers a swap-in it cannot read: a program that does not
    /// handle it dies at once, with the reason on stderr.
    pub(crate) fn unreadable(&self, page: usize, tid: u32, e: &netram_pager::PagerError) {
        let addr = self.base.page(page);
        let n = self.counters.sigbus.fetch_add(1, Ordering::Relaxed);
        // The message below is the user's; the log has it at debug level, not twice.
        tracing::debug!("page {page} cannot be read: {e}");
        if n < 8 {
            // stderr even without a tracing subscriber (the preload library has none): the
            // program's user must learn why it died.
            eprintln!(
                "netram: page {page} of a region (address {:#x}) cannot be read: {e}; \
                 SIGBUS to thread {tid}",
                addr as usize
            );
        }
        // SAFETY: getpid and tgkill take no pointers; tgkill signals one thread of this
        // process, the one blocked on the fault.
        let sent = tid != 0
            && unsafe {
                libc::syscall(
                    libc::SYS_tgkill,
                    libc::getpid(),
                    tid as libc::pid_t,
                    libc::SIGBUS,
                ) == 0
            };
        if !sent {
            // No thread id from this kernel: the process, whichever thread takes it.
            // SAFETY: kill(2) on this process's own PID, no pointers.
            unsafe { libc::kill(libc::getpid(), libc::SIGBUS) };
        }
        // Woken with the signal pending, the thread takes it before it retries the access.
        let _ = self.uffd.wake(addr, PAGE_SIZE);
    }
}
