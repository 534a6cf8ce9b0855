//! Fetching ahead: the pages `netram_policy::prefetch` proposes after a fault come in the
//! same pipelined read, most mapped at once, some left in the pager's cache to measure the hit
//! rate (Leap's majority trend; the kernel's swap readahead as the fallback).

use super::*;

impl<T: Transport, D: Disk> Shared<T, D> {
    /// The pages to fetch with `page`, which faults: what the prefetcher proposes that is
    /// neither here, in the pager's cache, nor on its way, and is stored somewhere (never-written pages are zero
    /// fills, not fetches).
    pub(crate) fn proposals(&self, st: &mut State<T, D>, page: usize) -> (Vec<u64>, Mode) {
        let (mut proposed, mode) = st.prefetcher.on_fault(page as u64, self.pages as u64);
        proposed.retain(|&p| {
            !st.clock.is_resident(p)
                && !st.prefetched.contains_key(&p)
                && !st.fetching.contains_key(&p)
                && st.holds(p)
        });
        (proposed, mode)
    }

    /// Installs `pages` fetched ahead (proposed by `mode`; their contents in `data`).
    ///
    /// Most are installed at once, so that a scan along them does not fault at all (the
    /// kernel's swap readahead still takes a minor fault per page; a fault here is a round
    /// trip to this thread). One in PREFETCH_CHECK is left in the pager's cache to be faulted
    /// on: whether those are used is the prefetcher's hit rate, and its depths follow it.
    pub(crate) fn install_ahead(
        &self,
        st: &mut State<T, D>,
        pages: &[u64],
        mode: Mode,
        data: &[u8],
    ) {
        let mut installed = 0;
        for (i, &p) in pages.iter().enumerate() {
            st.prefetch_seq = st.prefetch_seq.wrapping_add(1);
            if !st.prefetch_seq.is_multiple_of(PREFETCH_CHECK as u64) {
                let protect = st.protection.decide();
                let page = &data[i * PAGE_SIZE..(i + 1) * PAGE_SIZE];
                match self.uffd.copy(page, self.base.page(p as usize), protect) {
                    Ok(()) => {
                        st.dirty[p as usize] = !protect;
                        st.clock.insert(p);
                        installed += 1;
                        continue;
                    }
                    // Faulted in meanwhile, or the mapping is changing: leave it to faults.
                    Err(e) => tracing::debug!("installing prefetched page {p}: {e}"),
                }
            }
            st.prefetched.insert(p, mode);
            st.prefetch_order.push_back(p);
        }
        self.counters
            .prefetch_installed
            .fetch_add(installed, Ordering::Relaxed);
        self.counters
            .prefetched
            .fetch_add(pages.len() as u64 - installed, Ordering::Relaxed);
        // The pager's cache holds only so many: older guesses not used by now are taken as
        // wasted (the cache has probably evicted them).
        while st.prefetch_order.len() > st.prefetch_window {
            let old = st.prefetch_order.pop_front().expect("not empty");
            if let Some(mode) = st.prefetched.remove(&old) {
                st.prefetcher.wasted(mode);
            }
        }
    }
}
